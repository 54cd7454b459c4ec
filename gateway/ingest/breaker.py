"""The crash-loop breaker: a message that kills the process is quarantined, not processed a
third time.

An exception in processing is caught per message (``IngestWriter``) and dead-letters that
message alone. What no ``except`` sees is the process dying: a crash in a C extension, memory
exhausted, a hang the service manager's watchdog ends. The message was never acknowledged,
so the broker delivers it again after the restart, and again: one device's message would stop
ingest for the whole fleet, across every restart. So before each batch is decoded (decoders
are C extensions too) and stored, the digests of its messages are written to the node's
journal in PostgreSQL, on their own (committed before decoding begins); a clean stop empties
it. At start, what the journal
still holds was in flight when the node died: each such message counts one death
(``ingest_suspect``). A suspect is processed alone, so that the next death points at the
message that caused it and not at its batch-mates; once stored (or dead-lettered), it is
forgotten. A message in flight at ``quarantine_after`` deaths in a row becomes a dead letter,
``QUARANTINED``, with its raw bytes, and is acknowledged without being processed; it stays
remembered, so that the same message coming back (retained, repeated) is quarantined again,
until a successful replay of its letter forgets it.

The state is in PostgreSQL, not on the node's disk: a node moved to another host, or another
node of a shared subscription that receives the message next, counts the same deaths.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import asyncpg
import structlog

from gateway.ingest.decoder import Inbound
from storage import breaker as repo

log = structlog.get_logger(__name__)

QUARANTINED = "QUARANTINED"
# Deaths in a row with a message in flight after which it is not processed again.
QUARANTINE_AFTER = 2
# How long a suspect that never came back is remembered.
REMEMBER_DAYS = 7


def digest(item: Inbound) -> bytes:
    """What identifies a message across deliveries and nodes: its topic and payload (or, for
    one cut down on arrival, its whole payload's SHA-256)."""
    if item.digest is None:
        h = hashlib.blake2b(item.topic.encode(), digest_size=repo.DIGEST_BYTES)
        h.update(b"\x00")
        if item.sha256 is not None:
            h.update(item.sha256.encode())
        else:
            h.update(item.payload)
        item.digest = h.digest()
    return item.digest


class CrashLoopBreaker:
    def __init__(self, node_id: str, *, quarantine_after: int = QUARANTINE_AFTER) -> None:
        self.node_id = node_id
        self.quarantine_after = quarantine_after
        self.suspects: dict[bytes, int] = {}
        self._journaled: list[bytes] | None = None

    async def recover(self, conn: asyncpg.Connection) -> None:
        """At start: count a death for what the journal holds, and load every suspect."""
        self.suspects = await repo.recover_journal(conn, self.node_id, remember_days=REMEMBER_DAYS)
        self._journaled = None
        if self.suspects:
            log.warning(
                "ingest_suspects_loaded",
                suspects=len(self.suspects),
                at_limit=sum(1 for d in self.suspects.values() if d >= self.quarantine_after),
            )

    def deaths(self, item: Inbound) -> int:
        if not self.suspects:
            return 0
        return self.suspects.get(digest(item), 0)

    def split(self, batch: Sequence[Inbound]) -> tuple[list[Inbound], list[list[Inbound]]]:
        """The batch as ``(quarantined, groups)``: the messages at the limit of deaths, and
        the rest in groups stored one after the other, in order: each suspect alone, the
        messages between them together."""
        if not self.suspects:
            return [], [list(batch)]
        quarantined: list[Inbound] = []
        groups: list[list[Inbound]] = []
        current: list[Inbound] = []
        for item in batch:
            deaths = self.deaths(item)
            if deaths >= self.quarantine_after:
                quarantined.append(item)
            elif deaths:
                if current:
                    groups.append(current)
                    current = []
                groups.append([item])
            else:
                current.append(item)
        if current:
            groups.append(current)
        return quarantined, groups

    def quarantine_detail(self, item: Inbound) -> str:
        return (
            f"in flight each of the {self.deaths(item)} times in a row the gateway process "
            "died: kept here unprocessed (replay it once the cause is fixed)"
        )

    def isolating(self, items: Sequence[Inbound]) -> bool:
        """Whether ``items`` hold a suspect below the limit: one to be stored alone (a message
        at the limit is quarantined wherever it is, and needs nothing alone). Suspects that
        never come back cost nothing: only a batch holding one is stored alone."""
        if not self.suspects:
            return False
        limit = self.quarantine_after
        return any(0 < self.deaths(item) < limit for item in items)

    async def journal(self, conn: asyncpg.Connection, items: Sequence[Inbound]) -> None:
        """Before storing ``items``: they are what is in flight (a retry of the same messages
        writes nothing). The same statement tells what the fleet counted of them since this
        node started (another node's deaths, a quarantine, a replay that forgot one): the
        suspects of ``items`` are then as PostgreSQL has them."""
        digests = [digest(item) for item in items]
        if digests != self._journaled:
            counted = await repo.write_journal(
                conn, self.node_id, digests, remember_days=REMEMBER_DAYS
            )
            self._journaled = digests
            suspects = self.suspects
            for d in digests:
                deaths = counted.get(d)
                if deaths is not None:
                    suspects[d] = deaths
                elif suspects:
                    suspects.pop(d, None)

    async def settled(self, conn: asyncpg.Connection, items: Sequence[Inbound]) -> None:
        """After the commit that stored or dead-lettered ``items``: forget those suspected,
        except the ones quarantined, which stay remembered (from now) so that the same message
        coming back (retained and sent again at each subscription, repeated by its device,
        delivered again, to this node or another) is quarantined again, not processed a
        third time. A successful replay of its dead letter forgets it
        (``gateway.ingest.replay``)."""
        if not self.suspects:
            return
        done: list[bytes] = []
        kept: list[bytes] = []
        for item in items:
            deaths = self.suspects.get(d := digest(item))
            if deaths is not None:
                (kept if deaths >= self.quarantine_after else done).append(d)
        if done:
            await repo.forget_suspects(conn, done)
            for d in done:
                self.suspects.pop(d, None)
        if kept:
            await repo.keep_quarantined(conn, kept)

    async def clean_stop(self, conn: asyncpg.Connection) -> None:
        await repo.clear_journal(conn, self.node_id)
        self._journaled = None

    async def excuse(self, conn: asyncpg.Connection) -> None:
        """The database holds a write past the watchdog, which restarts the node: what is in
        flight did not kill it, and counts no death. A retry of the same messages does not
        journal them again (``_journaled`` is kept); a new batch does."""
        await repo.clear_journal(conn, self.node_id)
