"""Command dispatch, on every node (the reaper, its counterpart, is in ``reaper``).

The dispatcher claims due commands in one statement (generation + 1, this node, a lease),
publishes each downlink with QoS 1 and, on the broker's PUBACK, moves it CLAIMED → SENT —
guarded by generation, node and status, so a claim that lapsed meanwhile is left to its new
owner. A publish that fails leaves the claim to expire: the reaper returns it to PENDING (and
counts a reclaim). A write after the broker's answer (SENT, a release, a refusal's FAILED) that
meets the database away is tried again while the claim's lease lasts: the PUBACK is known to
this node alone.

The broker being away is not a node losing its commands: while the node's broker session is
down the dispatcher claims nothing (another node, whose session is up, may), a publish that
failed because the session went down returns its claim to PENDING at once without counting a
reclaim, and the session wakes the dispatcher when it is back. A downlink written before the
session went down, whose PUBACK never came, is in doubt: the broker may have delivered it, so it
is taken as SENT, never sent again at once; the device's receipt (held for the session) or the
ack window decides.

A downlink that has to wait for its slot under the broker's Receive Maximum (a slow broker:
a batch goes out as PUBACKs come back, seconds for its last commands) is published only if its
command is still this claim's and CLAIMED when the slot comes: a cancel committed meanwhile
stops it. The batch's waiting commands are read in one statement, at most every
``RECHECK_AFTER_S`` (see :class:`ClaimCheck`); a slot free at once asks nothing.

A downlink the broker can never take — larger than its maximum packet size (refused before
sending, or answered 0x95), a topic or payload it refuses for good, or a device id holding a
`.` where ``[mqtt] broker_family`` says the broker maps it (``BAD_DEVICE_ID``) — fails its
command at once (``FAILED``, ``raw_result_code`` the refusal's name, ``raw_ack`` why), whatever its
delivery class: a retry would be refused the same way, and a reclaim loop would hide it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from enum import Enum
from typing import Final, TypeVar

import asyncpg
import msgspec
import structlog

from gateway.commands import sparkplug as sparkplug_writes
from gateway.commands.lifecycle import DISPATCHER_ACTOR, fail_unsendable, mark_sent
from gateway.commands.metrics import CommandMetrics
from gateway.commands.receipts import AppliedReceipt, apply_receipt
from gateway.config import CommandsConfig
from gateway.domain.mappings import DownlinkError, Mappings
from gateway.support.backoff import Backoff
from gateway.support.broker_link import (
    BrokerLink,
    PublishInDoubt,
    PublishWithdrawn,
    Ready,
    SessionDown,
)
from gateway.support.loops import drain_on_notify, sleep_unless_stopped
from gateway.support.metrics import Metrics
from gateway.support.node import Node, Publish
from gateway.support.publish_refusal import PublishRefused, publish_packet_size
from protocol import (
    CommandReceipt,
    DownlinkCommand,
    ReceiptResult,
    Topics,
    encode_command,
    sparkplug,
)
from protocol.ids import UnportableDeviceIdError
from storage import commands as repo
from storage import ingest as repo_ingest
from storage.commands import CommandRow
from storage.errors import TRANSIENT_DB_ERRORS

log = structlog.get_logger(__name__)

NOTIFY_CHANNEL = "command_due"
# Claimed batches being published at once, per dispatcher.
PIPELINE = 4
RELEASE_NOTE = "broker session down: not published, not a reclaim"
COMMIT_LOST_NOTE = (
    "the claim's COMMIT went unanswered (the database away): not published, not a reclaim"
)
UNMAPPED_NOTE = (
    "the device mappings could not be read (the database away): not published, not a reclaim"
)
IN_DOUBT_NOTE = (
    "broker session lost after the downlink was written, before its PUBACK: the broker may"
    " have it; the device's receipt, or the ack window, decides"
)
# How old the batch's read of its claims may be when a downlink's slot comes after a wait
# before it is read again (in the background; waited for at twice this age): a cancel
# committed more than twice this before the slot came is never published.
RECHECK_AFTER_S: Final = 0.25
# One re-read may not hold a slot longer than this (the database away: published as claimed).
RECHECK_TIMEOUT_S: Final = 1.0
# A write after the broker's answer (SENT, a release) that met the database away is tried
# again after these delays (full jitter), for as long as the batch's claims last.
WRITE_RETRY_FIRST_S: Final = 0.1
WRITE_RETRY_CAP_S: Final = 1.0

T = TypeVar("T")


class Outcome(Enum):
    SENT = "sent"
    # The session was down: the claim goes back to PENDING, uncounted.
    SESSION_DOWN = "session_down"
    # Written, then the session went down before the PUBACK: the broker may have delivered it.
    # Taken as SENT (never sent again at once): the receipt, held for the session, or the ack
    # window decides, as for any downlink the broker took.
    IN_DOUBT = "in_doubt"
    # The broker refused it for now (its PUBACK: 0x87 not authorized, a quota, ...): answered
    # by the node as a device's FAILED receipt would be (a realtime command fails, a
    # deferrable one backs off), naming the refusal. No node went silent: no reclaim.
    REFUSED = "refused"
    # Anything else (no PUBACK in time, an error): the lease runs out, a reclaim.
    FAILED = "failed"
    # The broker can never take it (too large, a final refusal): the command fails now.
    UNSENDABLE = "unsendable"
    # Not published: its slot came after a wait, and the command was no longer this claim's
    # (cancelled, or lapsed) by then. Nothing to write.
    WITHDRAWN = "withdrawn"


class ClaimCheck:
    """Whether a claimed batch's commands are still its claims, for the downlinks that waited
    for a slot at the broker. The claim's own read serves first. Once the last read is
    ``after_s`` old, one statement reads the batch's undecided commands again, in the
    background: the downlinks go on with the last read meanwhile, so that a busy database
    does not hold the broker's slots idle. Only once it is twice that old (a broker slow
    enough for long gaps) does a downlink wait for the new read."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        rows: Sequence[CommandRow],
        *,
        node_id: str,
        after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.node_id = node_id
        self.after_s = after_s
        self.clock = clock
        self.generations = {row.id: row.claim_generation for row in rows}
        self.undecided = set(self.generations)
        self.withdrawn: set[int] = set()
        self.read_at = clock()  # the claim read them
        self._reading: asyncio.Task[None] | None = None

    async def close(self) -> None:
        """Once the batch is published: wait for a read still under way (never long)."""
        if self._reading is not None:
            await asyncio.shield(self._reading)

    def ready(self, command_id: int) -> Ready:
        async def ready() -> bool:
            return await self.still_claimed(command_id)

        return ready

    async def still_claimed(self, command_id: int) -> bool:
        age = self.clock() - self.read_at
        if age >= self.after_s and self._reading is None:
            self._reading = asyncio.create_task(self._read(), name="downlink-recheck")
        if age >= 2 * self.after_s and self._reading is not None:
            await asyncio.shield(self._reading)
        self.undecided.discard(command_id)
        return command_id not in self.withdrawn

    async def _read(self) -> None:
        started = self.clock()
        ids = sorted(self.undecided)
        try:
            async with asyncio.timeout(RECHECK_TIMEOUT_S):
                still = await repo.still_claimed(
                    self.pool, [(i, self.generations[i]) for i in ids], node_id=self.node_id
                )
        except Exception as exc:  # the database away, or slow: published as claimed
            log.warning("downlink_recheck_failed", commands=len(ids), error=repr(exc))
        else:
            self.withdrawn.update(set(ids) - still)
        finally:
            self.read_at = started
            self._reading = None


class Dispatcher:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        dsn: str,
        node_id: str,
        topics: Topics,
        publish: Publish,
        metrics: Metrics,
        lease_s: float,
        sent_timeout_s: float,
        batch: int = 100,
        max_in_flight: int = 1,
        poll_s: float = 1.0,
        broker: BrokerLink | None = None,
        mappings: Mappings | None = None,
    ) -> None:
        self.pool = pool
        # [[ingest.mappings]]: a device seen through one gets its commands on the mapping's
        # command_topic, rendered from its template (swapped whole on reload).
        self.mappings = mappings or Mappings()
        self.dsn = dsn
        self.node_id = node_id
        self.topics = topics
        self.publish = publish
        self.metrics = metrics
        self.command_metrics = CommandMetrics.of(metrics.registry)
        self.lease_s = lease_s
        self.sent_timeout_s = sent_timeout_s
        self.batch = batch
        self.max_in_flight = max_in_flight
        self.poll_s = poll_s
        self.broker = broker or BrokerLink()
        self._wakeup = self.broker.wakeup()
        self._slots = asyncio.Semaphore(PIPELINE)
        self._sending: set[asyncio.Task[None]] = set()
        self._refusals: dict[int, tuple[str, str]] = {}  # command id: code, reason
        # How old a batch's read of its claims may be for a downlink whose slot came late.
        self.recheck_after_s = RECHECK_AFTER_S
        # Set by run()'s stop: a write retried while the database is away gives up at once.
        self._stop = asyncio.Event()

    @classmethod
    def from_config(
        cls, node: Node, commands: CommandsConfig, *, mappings: Mappings | None = None
    ) -> Dispatcher:
        return cls(
            pool=node.pool,
            dsn=node.dsn,
            node_id=node.node_id,
            topics=node.topics,
            publish=node.publish,
            metrics=node.metrics,
            lease_s=commands.lease_s,
            sent_timeout_s=commands.sent_timeout_s,
            batch=commands.dispatch_batch,
            max_in_flight=commands.max_in_flight_per_device,
            broker=node.broker,
            mappings=mappings,
        )

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        try:
            await drain_on_notify(
                dsn=self.dsn,
                channel=NOTIFY_CHANNEL,
                stop=stop,
                step=self.run_once,
                poll_s=self.poll_s,
                name="command-dispatcher",
                wakeup=self._wakeup,
            )
        finally:
            await self.flush()

    async def run_once(self) -> int:
        """Claim due commands and start sending them; how many were claimed.

        Up to ``PIPELINE`` claimed batches are being sent at once: the next claim does not wait
        for the PUBACKs of the last batch (the round trips overlap), and a slot is taken before
        claiming, so a node never holds claims it cannot send yet. :meth:`flush` waits for them.
        Nothing is claimed while the broker session is down: the claims could only fail. The
        session is asked first (a pass while it is down waits for nothing) and again right
        before the claim's statement, once the slot and a connection are had; what is left is
        the statement itself, the session lost while it runs (its claims are then released).
        """
        if not self.broker.up():
            return 0
        await self._slots.acquire()
        # The claims' leases start in the claim's statement, after this: they last at least
        # until then (the writes after the broker's answers are tried again until then).
        lease_end = asyncio.get_running_loop().time() + self.lease_s
        try:
            async with self.pool.acquire() as conn:
                # Asked again, at the last moment before the claim: the wait for a slot (the
                # last batches' PUBACKs) or for a connection (a busy pool) may have outlasted
                # the session. A pass that asked only before them claimed a batch for a
                # broker it could not reach, and released it unpublished at once.
                claimed = (
                    await repo.claim_due(
                        conn,
                        node_id=self.node_id,
                        lease_s=self.lease_s,
                        limit=self.batch,
                        max_in_flight=self.max_in_flight,
                        actor=DISPATCHER_ACTOR,
                        mappings=list(self.mappings.by_name),
                    )
                    if self.broker.up()
                    else []
                )
        except repo.ClaimCommitLostError as lost:
            # Committed or not, nothing of it was published: what did commit goes back to
            # PENDING now, uncounted (it used to wait for its lease, and be reclaimed against
            # this node). Then the pass fails as any pass the database failed.
            self._slots.release()
            released = await self._release(lost.rows, lease_end=lease_end, note=COMMIT_LOST_NOTE)
            if released:  # those claims did commit
                self.metrics.count_command("PENDING", "CLAIMED", released)
            raise lost.error from None
        except BaseException:
            self._slots.release()
            raise
        if not claimed:
            self._slots.release()
            return 0
        self.command_metrics.command_claim_batch.observe(len(claimed))
        self.metrics.count_command("PENDING", "CLAIMED", len(claimed))
        task = asyncio.create_task(self._send_batch(claimed, lease_end), name="command-send")
        self._sending.add(task)
        task.add_done_callback(self._sent)
        return len(claimed)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            # The claims stay CLAIMED: their leases run out and the reaper requeues them.
            log.warning("downlink_batch_failed", error=repr(task.exception()))

    async def flush(self) -> None:
        """Wait until every claimed batch has been sent and its SENT writes are done."""
        while self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    async def _send_batch(self, claimed: list[CommandRow], lease_end: float) -> None:
        # Downlinks all go out at once; their PUBACKs' SENT writes then go in one statement.
        mapped: dict[str, tuple[str, dict[str, str]]] = {}
        if self.mappings:
            try:
                mapped = await repo_ingest.device_mappings(
                    self.pool, sorted({row.device_id for row in claimed})
                )
            except TRANSIENT_DB_ERRORS:
                # Nothing published: the claims go back now, not at their lease's end (a
                # reclaim against this node). The batch then fails as before.
                await self._release(claimed, lease_end=lease_end, note=UNMAPPED_NOTE)
                raise
        check = ClaimCheck(self.pool, claimed, node_id=self.node_id, after_s=self.recheck_after_s)
        outcomes = await asyncio.gather(
            *(self._publish(row, check, mapped.get(row.device_id)) for row in claimed)
        )
        await check.close()
        paired = list(zip(claimed, outcomes, strict=True))
        withdrawn = [row.id for row, outcome in paired if outcome is Outcome.WITHDRAWN]
        if withdrawn:
            # Cancelled (or lapsed) while waiting for the broker: never sent.
            log.info("downlinks_withdrawn", command_ids=withdrawn)
        await self._mark_sent(
            [row for row, outcome in paired if outcome is Outcome.SENT], lease_end=lease_end
        )
        in_doubt = [row for row, outcome in paired if outcome is Outcome.IN_DOUBT]
        if in_doubt:
            log.info("downlinks_in_doubt", command_ids=[row.id for row in in_doubt])
        await self._mark_sent(in_doubt, note=IN_DOUBT_NOTE, lease_end=lease_end)
        await self._release(
            [row for row, outcome in paired if outcome is Outcome.SESSION_DOWN],
            lease_end=lease_end,
        )
        await self._fail(
            [row for row, outcome in paired if outcome is Outcome.UNSENDABLE], lease_end=lease_end
        )
        await self._refused(
            [row for row, outcome in paired if outcome is Outcome.REFUSED], lease_end=lease_end
        )

    async def _publish(
        self, row: CommandRow, check: ClaimCheck, mapped: tuple[str, dict[str, str]] | None = None
    ) -> Outcome:
        if sparkplug.is_device_key(row.device_id):
            # A Sparkplug device's command: its metric write as DCMD/NCMD (commands/sparkplug.py).
            try:
                topic, payload = await sparkplug_writes.downlink(
                    self.pool, row.device_id, row.name, row.params
                )
            except sparkplug_writes.SparkplugWriteError as exc:
                self._refusals[row.id] = (exc.code, f"not sent: {exc.reason}")
                return Outcome.UNSENDABLE
            return await self._send(row, check, topic, payload)
        if mapped is not None:
            try:
                vendor = self.mappings.downlink(
                    mapped[0],
                    mapped[1],
                    device_id=row.device_id,
                    command=row.name,
                    command_id=row.id,
                    params=_params(row.params),
                )
            except DownlinkError as exc:
                self._refusals[row.id] = (exc.code, exc.detail)
                return Outcome.UNSENDABLE
            if vendor is not None:
                outcome = await self._send(row, check, vendor.topic, vendor.payload)
                # A vendor device answers no receipt, and the ack window spares it: nothing
                # would ever settle the doubt, so it goes again, released as if unsent.
                return Outcome.SESSION_DOWN if outcome is Outcome.IN_DOUBT else outcome
        downlink = DownlinkCommand(
            command_id=row.id,
            claim_generation=row.claim_generation,
            node_id=self.node_id,
            name=row.name,
            params=_params(row.params),
            deadline=row.expire_at,
        )
        try:
            topic = self.topics.commands(row.device_id)
        except UnportableDeviceIdError as exc:  # stored before [mqtt] broker_family said so
            self._refusals[row.id] = ("BAD_DEVICE_ID", f"not sent: {exc}")
            return Outcome.UNSENDABLE
        return await self._send(row, check, topic, encode_command(downlink))

    async def _send(
        self, row: CommandRow, check: ClaimCheck, topic: str, payload: bytes
    ) -> Outcome:
        try:
            await self.publish(topic, payload, ready=check.ready(row.id))
        except SessionDown as exc:  # written before it went down: in doubt, not unsent
            return Outcome.IN_DOUBT if isinstance(exc, PublishInDoubt) else Outcome.SESSION_DOWN
        except PublishWithdrawn:
            return Outcome.WITHDRAWN
        except PublishRefused as exc:
            if exc.final:
                self._refusals[row.id] = (exc.reason, f"not sent: {exc}")
                return Outcome.UNSENDABLE
            self._refusals[row.id] = (exc.reason, f"refused by the broker: {exc}")
            return Outcome.REFUSED
        except Exception as exc:  # the lease runs out and the reaper requeues it
            log.warning("downlink_publish_failed", command_id=row.id, error=repr(exc))
            return Outcome.FAILED
        return Outcome.SENT

    async def _while_claimed(self, write: Callable[[], Awaitable[T]], *, lease_end: float) -> T:
        """``write`` (one statement, guarded by the claim), tried again while the database is
        away and the claims last: the broker's answer is known to this node alone, and lost
        to a database restart the claim lapsed, was counted a reclaim (blaming the node) and
        its downlink went to the device again. Past the lease, or at a stop, the error is
        raised: the claim is left to the reaper, as before."""
        backoff = Backoff(WRITE_RETRY_FIRST_S, WRITE_RETRY_CAP_S)
        loop = asyncio.get_running_loop()
        while True:
            try:
                return await write()
            except TRANSIENT_DB_ERRORS as exc:
                delay = backoff.next_delay()
                if self._stop.is_set() or loop.time() + delay >= lease_end:
                    raise
                log.warning("downlink_write_retried", error=repr(exc), retry_in_s=round(delay, 3))
                await sleep_unless_stopped(self._stop, delay)

    async def _release(
        self, rows: list[CommandRow], *, lease_end: float, note: str = RELEASE_NOTE
    ) -> int:
        """Claims whose downlink the session could not take (or whose claim's COMMIT went
        unanswered, ``note`` says which): PENDING again, uncounted; how many.

        One statement per claim (outside any transaction), so this never holds one row's lock
        while waiting for another's. A release that fails leaves the claim to its lease (a
        reclaim then, as before this existed).
        """
        released = 0
        for row in rows:
            if await self._while_claimed(
                functools.partial(
                    repo.release_unsent,
                    self.pool,
                    row.id,
                    row.claim_generation,
                    node_id=self.node_id,
                    actor=DISPATCHER_ACTOR,
                    note=note,
                ),
                lease_end=lease_end,
            ):
                released += 1
        if rows:
            log.info("downlinks_released", claimed=len(rows), released=released, note=note)
        if released:
            self.metrics.count_command("CLAIMED", "PENDING", released)
        return released

    async def _fail(self, rows: list[CommandRow], *, lease_end: float) -> None:
        """Claims whose downlink the broker can never take: FAILED now, with the reason.

        One transaction per claim (its audit row and ``command.finished`` event with it), tried
        again while the database is away and the lease lasts. One that fails to be written
        even so leaves the claim to its lease: the next claim meets the same refusal and fails
        it then.
        """
        failed = 0
        for row in rows:
            code, reason = self._refusals.pop(row.id)
            done = await self._while_claimed(
                functools.partial(self._fail_one, row, code, reason), lease_end=lease_end
            )
            if done is not None:
                failed += 1
            log.warning(
                "downlink_unsendable",
                command_id=row.id,
                device_id=row.device_id,
                code=code,
                reason=reason,
                failed=done is not None,
            )
        if failed:
            self.metrics.count_command("CLAIMED", "FAILED", failed)

    async def _fail_one(self, row: CommandRow, code: str, reason: str) -> CommandRow | None:
        async with self.pool.acquire() as conn, conn.transaction():
            return await fail_unsendable(conn, row, node_id=self.node_id, code=code, reason=reason)

    async def _refused(self, rows: list[CommandRow], *, lease_end: float) -> None:
        """Claims whose downlink the broker refused for now (an ACL, a quota): the node
        answers each as a device's FAILED receipt would, with the refusal's code and reason
        (a realtime command FAILED, a deferrable one PENDING again after its backoff, the 11th
        time TIMEOUT). One transaction per claim, tried again while the database is away and
        the lease lasts (the refusal is known to this node alone); one that fails to be
        written even so leaves the claim to its lease, as before. A retry after a COMMIT whose
        answer was lost writes nothing if that COMMIT did (see :meth:`_refuse_one`)."""
        for row in rows:
            code, reason = self._refusals.pop(row.id)
            own = CommandReceipt(
                command_id=row.id,
                claim_generation=row.claim_generation,
                node_id=self.node_id,
                result=ReceiptResult.FAILED,
                raw_result_code=code,
                raw_ack=f"{reason} (reported by {self.node_id})",
            )
            applied = await self._while_claimed(
                functools.partial(self._refuse_one, row, own, []), lease_end=lease_end
            )
            moved = applied.command
            log.warning(
                "downlink_refused",
                command_id=row.id,
                device_id=row.device_id,
                code=code,
                reason=reason,
                status=None if moved is None else moved.status,
            )
            if moved is not None and applied.previous_status not in (None, moved.status):
                self.metrics.count_command(str(applied.previous_status), moved.status, 1)

    async def _refuse_one(
        self, row: CommandRow, own: CommandReceipt, tried: list[AppliedReceipt]
    ) -> AppliedReceipt:
        """``own`` applied in a transaction of its own; ``tried``: what each earlier attempt of
        this write applied before its COMMIT (appended to here).

        An attempt whose COMMIT's answer was lost (the link cut as the server committed) may
        have committed: its retry used to apply the receipt again, keeping a second copy of
        the node's own receipt (``duplicated``: the command was closed already) and counting
        no transition. So every attempt first locks the command's row (an earlier attempt
        still committing holds it: waited for), and a retry that then finds ``own`` kept
        answers what the attempt that kept it applied, writing nothing."""
        async with self.pool.acquire() as conn, conn.transaction():
            await repo.lock_command(conn, row.id)
            if tried and await repo.own_receipt_kept(
                conn,
                row.id,
                row.claim_generation,
                self.node_id,
                result=own.result.value,
                raw_result_code=None if own.raw_result_code is None else str(own.raw_result_code),
                raw_ack=own.raw_ack,
            ):
                log.info("downlink_refusal_found_kept", command_id=row.id)
                return tried[-1]
            applied = await apply_receipt(
                conn,
                device_id=row.device_id,
                receipt=own,
                node_id=self.node_id,
                sent_timeout_s=self.sent_timeout_s,
            )
            tried.append(applied)
            return applied

    async def _mark_sent(
        self, rows: list[CommandRow], *, lease_end: float, note: str | None = None
    ) -> None:
        if not rows:
            return
        done = await self._while_claimed(
            lambda: repo.mark_sent_many(
                self.pool,
                [(row.id, row.claim_generation) for row in rows],
                node_id=self.node_id,
                timeout_s=self.sent_timeout_s,
                actor=DISPATCHER_ACTOR,
                note=note,
            ),
            lease_end=lease_end,
        )
        count = len(done)
        # Rows a receipt transaction held were skipped rather than waited for (a statement
        # holding a batch of locks must not wait: two such would deadlock); one by one now.
        for row in rows:
            if row.id in done:
                continue
            alone = await self._while_claimed(
                functools.partial(
                    mark_sent,
                    self.pool,
                    row,
                    node_id=self.node_id,
                    sent_timeout_s=self.sent_timeout_s,
                    note=note,
                ),
                lease_end=lease_end,
            )
            if alone is None:
                # The claim lapsed (another node has it now), or the device answered before
                # the PUBACK was handled and its receipt already moved the command on.
                log.info("downlink_claim_lapsed", command_id=row.id)
            else:
                count += 1
        if count:
            self.metrics.count_command("CLAIMED", "SENT", count)


# The narrowest a downlink's deadline is encoded (no fraction of a second): a lower bound.
_DEADLINE = datetime(2000, 1, 1, tzinfo=UTC)


def smallest_downlink(topic: str, name: str, params: dict[str, object], *, mqtt5: bool) -> int:
    """The fewest bytes the PUBLISH of this command's downlink can take, whatever node sends it
    and whatever its id and claim: with the shortest id, generation and node id there are."""
    body = encode_command(
        DownlinkCommand(
            command_id=1,
            claim_generation=1,
            node_id="",
            name=name,
            params=params,
            deadline=_DEADLINE,
        )
    )
    return publish_packet_size(topic, len(body), qos=1, mqtt5=mqtt5)


def _params(value: object) -> dict[str, object]:
    decoded = msgspec.json.decode(value) if isinstance(value, str | bytes) else value
    assert isinstance(decoded, dict)
    return decoded
