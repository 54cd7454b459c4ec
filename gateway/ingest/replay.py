"""Replay of dead letters through the normal ingest path.

Each dead letter is decoded again with today's decoder and, if it now passes, stored by
the same ``store`` the live pipeline uses — with the rules (the alarm engine), the command
receipts and presence, built as the daemon builds them (``gateway.ingest.live_path``) — in one
transaction with the dead letter's replay record. Event ids make a replay of something already
stored a harmless duplicate, which raises nothing again; a command receipt, which has none, is
not applied again once its letter was replayed successfully.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
import structlog

from gateway.commands.receipts import AppliedReceipt
from gateway.domain.errors import ConcurrentWriteError
from gateway.ingest.breaker import QUARANTINED, digest
from gateway.ingest.decoder import Classified, Inbound, failure_detail
from gateway.ingest.live_path import LivePath
from gateway.ingest.store import StoreResult, store
from gateway.ingest.writer import RETRY_LATER, refusal_reason
from storage import breaker as breaker_repo
from storage import ingest as repo

log = structlog.get_logger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MILLISECOND = timedelta(milliseconds=1)


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    dead_letter_id: int
    outcome: str
    succeeded: bool


# Attempts of a replay whose transaction met another node's write of the same alarm or rule
# state (ConcurrentWriteError): each attempt starts over and sees that write, as the live
# writer's retried batch does; one more is as rare as another race in the same moment.
CONCURRENT_ATTEMPTS = 5


async def replay_one(
    pool: asyncpg.Pool, path: LivePath, dead_letter_id: int, *, pending_only: bool = False
) -> ReplayOutcome | None:
    """None when the id does not exist or another replayer holds it right now; with
    ``pending_only``, also when it was replayed successfully already (by another node since
    it was listed as pending: it is not replayed a second time). A transaction that met
    another node's write of the same alarm (ConcurrentWriteError) is made again from the
    start, as the live writer retries its batch; it raises only if every attempt did."""
    for attempt in range(1, CONCURRENT_ATTEMPTS + 1):
        try:
            return await _replay_once(pool, path, dead_letter_id, pending_only=pending_only)
        except ConcurrentWriteError as exc:
            if attempt == CONCURRENT_ATTEMPTS:
                raise
            log.info(
                "dead_letter_replay_retried",
                dead_letter_id=dead_letter_id,
                attempt=attempt,
                error=str(exc),
            )
    raise AssertionError("unreachable")


async def _replay_once(
    pool: asyncpg.Pool, path: LivePath, dead_letter_id: int, *, pending_only: bool
) -> ReplayOutcome | None:
    alarms = None
    receipts: tuple[AppliedReceipt, ...] = ()
    async with pool.acquire() as conn, conn.transaction():
        letter = await repo.lock_dead_letter(conn, dead_letter_id)
        if letter is None or (pending_only and letter.replayed_at is not None):
            return None
        # Read at the time it was received, as live: a mapping whose payload carries no time
        # takes the receive time, and the same letter must be the same reading (event id) at
        # every replay, on every node.
        received_ms = (letter.received_at - _EPOCH) // _MILLISECOND
        inbound = Inbound(topic=letter.topic, payload=letter.payload, received_ms=received_ms)
        classified = path.decoder.classify([inbound])
        superseded = await _drop_superseded_presence(conn, classified, letter.received_at)
        if letter.truncated:
            # Only its first bytes were kept: there is nothing whole to ingest.
            outcome, succeeded = "truncated", False
        elif classified.empty:
            # Zero bytes (a retained message cleared), a letter until this release: nothing
            # to ingest, and nothing wrong.
            outcome, succeeded = "empty", True
        elif classified.dead_letters:
            outcome, succeeded = f"still_invalid: {classified.dead_letters[0].reason}", False
        elif classified.receipts and letter.replayed_at is not None:
            # Applied by the replay that succeeded already: a receipt has no event id, and
            # applied again it was kept (and counted) a second time, `duplicated`, for the one
            # answer the device sent (a retry after a lost COMMIT answer, a double click).
            outcome, succeeded = "duplicate", True
        else:
            try:
                # A savepoint: a message the database or the rules still refuse leaves the
                # transaction able to record that.
                async with conn.transaction():
                    result = await store(
                        conn,
                        classified,
                        path.node_id,
                        path.engine,
                        path.receipts,
                        sparkplug=path.sparkplug,
                        # Heard when it was received, not now: a device silent since stays
                        # silent (its last_seen, its inactivity alarm).
                        received_at=letter.received_at,
                        # Refused again, it is reported, not counted as seen again.
                        write_letters=False,
                    )
            except Exception as exc:
                if isinstance(exc, RETRY_LATER):
                    raise
                reason = refusal_reason(exc)
                log.warning(
                    "dead_letter_replay_refused",
                    dead_letter_id=dead_letter_id,
                    reason=reason,
                    error=failure_detail(exc),
                )
                outcome, succeeded = f"still_invalid: {reason}", False
            else:
                alarms, receipts = result.alarms, result.receipts
                outcome = _outcome(result, classified, superseded=superseded)
                succeeded = not outcome.startswith("still_invalid")
                if result.dead_letters:
                    log.info(
                        "dead_letter_replay_refused",
                        dead_letter_id=dead_letter_id,
                        reason=result.dead_letters[0].reason,
                        detail=result.dead_letters[0].detail,
                    )
        await repo.mark_dead_letter_replayed(conn, dead_letter_id, outcome, succeeded=succeeded)
        if succeeded and letter.reason == QUARANTINED:
            # The cause is fixed: the crash-loop breaker, which keeps a quarantined message
            # quarantined when it comes back, forgets it (each node as it next journals it).
            await breaker_repo.forget_suspects(conn, [digest(inbound)])
    # Committed: only now are its alarms and receipts counted.
    if alarms is not None:
        path.engine.committed(alarms)
    path.receipts.committed(receipts)
    return ReplayOutcome(dead_letter_id, outcome, succeeded)


async def _drop_superseded_presence(
    conn: asyncpg.Connection, classified: Classified, received_at: datetime
) -> bool:
    """Leave out of ``classified`` the presence of each device that said something after
    ``received_at`` (a newer presence, or anything at all): applied now it would overwrite the
    present with the past (an ``offline`` from last week for a device talking now: a "presence
    offline" alarm). True when that left no presence to apply."""
    if not classified.presence:
        return False
    newer = await repo.heard_since(conn, list(classified.presence), received_at)
    for device_id in newer:
        del classified.presence[device_id]
    return bool(newer) and not classified.presence


def _outcome(result: StoreResult, classified: Classified, *, superseded: bool) -> str:
    if result.sparkplug is not None and result.sparkplug.dead_letters:
        # Judged again against its edge node's state, and still not readable.
        return f"still_invalid: {result.sparkplug.dead_letters[0].reason}"
    if result.telemetry:
        return "stored" if result.stored else "duplicate"
    if classified.receipts:
        return "receipt"
    return "presence_superseded" if superseded else "presence"


async def pending_ids(pool: asyncpg.Pool, reason: str | None) -> list[int]:
    ids: list[int] = []
    after = 0
    async with pool.acquire() as conn:
        while True:
            page = await repo.list_dead_letters(
                conn, reason=reason, pending_only=True, after_id=after, limit=1000
            )
            if not page:
                return ids
            ids.extend(letter.id for letter in page)
            after = page[-1].id


async def quarantined_ids(pool: asyncpg.Pool, ids: Sequence[int]) -> set[int]:
    """Those of ``ids`` whose letter is ``QUARANTINED``: a message the process died of, to be
    replayed in a process of its own (:mod:`gateway.ingest.replay_process`)."""
    async with pool.acquire() as conn:
        return await repo.dead_letters_of_reason(conn, ids, QUARANTINED)


async def replay(
    pool: asyncpg.Pool,
    path: LivePath,
    ids: Iterable[int],
    *,
    again: bool = False,
    on_outcome: Callable[[ReplayOutcome], None] | None = None,
) -> list[ReplayOutcome]:
    """Replay ``ids`` in turn. A letter replayed successfully already is left out (another
    node replaying the pending letters at the same time took it since they were listed),
    unless ``again`` (named by id: replayed once more, a harmless ``duplicate``).
    ``on_outcome`` is told each letter's outcome once its transaction committed: a run that
    fails midway (the database gone) has told what it did before."""
    outcomes = []
    for dead_letter_id in ids:
        outcome = await replay_one(pool, path, dead_letter_id, pending_only=not again)
        if outcome is not None:
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
    return outcomes
