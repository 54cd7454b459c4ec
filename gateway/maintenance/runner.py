"""The maintenance pass, on one node at a time.

Every node runs the loop; a pass first takes a session advisory lock on a connection it keeps
for the whole pass (``pg_try_advisory_lock``): the node that gets it does the work, the others
skip that round. A node that dies mid-pass loses its session and with it the lock, and a later
pass anywhere picks up where it stopped: every step is idempotent and each batch is its own
short transaction (no huge DELETE holding locks and filling the WAL). A node that stops without
dying (its VM paused, its process stopped, its link silent) has its session ended by the server
once it sits ``lock_holder_idle_s`` between statements (``storage.maintenance.try_lock``): TCP
keepalive never ends it while the node's kernel answers, and every other node skipped every
pass until someone killed that process.

A pass, with ``now`` from the database's clock: the one that stamped every row it compares
(received_at, last_seen_at, published_at, finished_at ...). A node's wall clock that jumped (a
dead RTC, a bad NTP server, a VM restored from a snapshot) once decided the cut-offs: a year
ahead, a pass pruned everything as a year old; a year behind, it made last year's partitions.
The node's clock now only tells the skew (``maintenance_clock_skew``); the last-pass metric is
the pass's ``now`` and its length, on the database's clock too.

1. creates the telemetry partitions of today and the ``partitions_ahead_days`` days after it
   (rows of those days waiting in the default partition move into them);
2. drops the day partitions whose whole day is older than ``telemetry_days`` and deletes the
   default partition's rows older than that (a day is kept while any of it is in the window);
3. prunes dead letters, audit rows, receipts, published and DEAD outbox events (and consumer
   records) and AI payloads older than their settings, never a live row, expired stream tickets,
   and the ``command_hearing`` rows of nodes unseen for ``COMMAND_HEARING_KEEP`` (a day);
4. samples rows and bytes per table and the oldest telemetry day into the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Final

import asyncpg
import structlog

from gateway.config import RetentionConfig
from gateway.maintenance.metrics import MaintenanceMetrics
from gateway.support.loops import FAILURE_BACKOFF_CAP_S, every
from gateway.support.metrics import Metrics
from gateway.support.node import Node
from storage import maintenance as repo
from storage.errors import DB_ERRORS

log = structlog.get_logger(__name__)

# The tables whose size the metrics report (telemetry summed over its partitions).
MEASURED_TABLES: Final = (
    "ai_task",
    "alarm",
    "alarm_audit",
    "command",
    "command_audit",
    "command_receipt",
    "consumed_event",
    "dead_letter",
    "dead_letter_audit",
    "device",
    "notify_delivery",
    "outbox_event",
    "rule_state",
    "telemetry",
)
# Rows looked at per statement (walked tables) and default-partition pages per statement:
# each batch is a short transaction whatever the backlog.
CHUNK_ROWS: Final = 5000
DEFAULT_PARTITION_PAGES: Final = 256
# A node's command_hearing row unseen this long goes (its node retired, or its id gone for
# good): it stopped counting COMMAND_HEARING_LIVE_S (a minute) after the node's last pass. Not
# a retention setting: the row is of no use to anyone by then, and a node back later writes it
# again.
COMMAND_HEARING_KEEP: Final = timedelta(days=1)
# A node's clock further than this from the database's is logged at each pass.
CLOCK_SKEW_WARN: Final = timedelta(minutes=5)

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


def utc_day(moment: datetime) -> date:
    return moment.astimezone(UTC).date()


def day_start(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def telemetry_cutoff(now: datetime, days: int) -> datetime:
    """The start of the oldest UTC day kept: a day goes once all of it is ``days`` old."""
    return day_start(utc_day(now - timedelta(days=days)))


def days_ahead(now: datetime, ahead: int) -> list[date]:
    """Today and the ``ahead`` days after it (UTC)."""
    today = utc_day(now)
    return [today + timedelta(days=n) for n in range(ahead + 1)]


@dataclass(slots=True)
class PassReport:
    """What one pass did; ``ran`` is false when another node held the lock."""

    ran: bool
    created: list[date] = field(default_factory=list)
    dropped: list[date] = field(default_factory=list)
    deleted: dict[str, int] = field(default_factory=dict)


class Maintenance:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        retention: RetentionConfig,
        metrics: Metrics,
        clock: Clock = utc_now,
        db_clock: Clock | None = None,
        chunk_rows: int = CHUNK_ROWS,
        default_partition_pages: int = DEFAULT_PARTITION_PAGES,
        on_locked: Callable[[], Awaitable[None]] | None = None,
        partition_lock_timeout: str = repo.PARTITION_LOCK_TIMEOUT,
        lock_holder_idle_s: float = repo.LOCK_HOLDER_IDLE_S,
    ) -> None:
        self.pool = pool
        self.retention = retention
        self.metrics = metrics
        self.retention_metrics = MaintenanceMetrics.of(metrics.registry)
        # The node's wall clock: the skew's log line only.
        self.clock = clock
        # The pass's now: None, the database's (read as the pass starts); tests, a later day.
        self.db_clock = db_clock
        self.chunk_rows = chunk_rows
        self.default_partition_pages = default_partition_pages
        self.partition_lock_timeout = partition_lock_timeout
        self.lock_holder_idle_s = lock_holder_idle_s
        # Tests only: awaited once the lock is held, to hold a pass there while another runs.
        self.on_locked = on_locked
        # A pass of this node failed, and none ran since (see _next_pass_in).
        self._owed = False

    @classmethod
    def from_config(cls, node: Node, retention: RetentionConfig) -> Maintenance:
        return cls(pool=node.pool, retention=retention, metrics=node.metrics)

    async def run(self, stop: asyncio.Event) -> None:
        # Read after each pass: a reload's [retention] applies from the next one.
        await every(self._next_pass_in, stop, self._step, name="maintenance")

    def _next_pass_in(self) -> float:
        """The wait after a pass: ``interval_s`` (read after each pass: a reload's [retention]
        applies from the next one), or the failure backoff's cap while a pass of this node is
        owed. A pass cut off by the database (the link, not the server) can leave its session
        on the server, still running its statement and holding the lock until it tries to
        answer: the retry finds the lock taken and skips, and that skip waited a whole
        interval (an hour by default) for a pass nobody ran."""
        return FAILURE_BACKOFF_CAP_S if self._owed else self.retention.interval_s

    async def _step(self) -> None:
        try:
            report = await self.run_once()
        except BaseException:
            self._owed = True
            raise
        if report.ran:
            self._owed = False

    async def run_once(self) -> PassReport:
        """One pass, if no other node is running one."""
        async with self.pool.acquire() as conn:
            if not await repo.try_lock(conn, idle_s=self.lock_holder_idle_s):
                log.debug("maintenance_skipped", reason="another node holds the lock")
                return PassReport(ran=False)
            try:
                if self.on_locked is not None:
                    await self.on_locked()
                report = await self._pass(conn, await self._now(conn))
            finally:
                await self._unlock(conn)
        if report.created or report.dropped or any(report.deleted.values()):
            log.info(
                "maintenance_done",
                partitions_created=[d.isoformat() for d in report.created],
                partitions_dropped=[d.isoformat() for d in report.dropped],
                deleted=report.deleted,
            )
        return report

    @staticmethod
    async def _unlock(conn: asyncpg.Connection) -> None:
        """Let the lock go, never hiding why a pass failed.

        A connection lost under the pass (the database restarted or cut away) took the lock
        with its session; asyncpg has already taken it back from this pass, and any call on it
        raises ``InterfaceError(... released back to the pool)``: raised here, that replaced
        the pass's own error in the log. An unlock that fails on a connection still open cuts
        it, so that the lock never goes back to the pool with it (the pool keeps sessions as
        they are: ``storage.pool``)."""
        try:
            await repo.unlock(conn)
        except DB_ERRORS as exc:
            log.debug("maintenance_unlock_failed", error=repr(exc), note="the session goes")
            with contextlib.suppress(asyncpg.InterfaceError):
                conn.terminate()

    async def _now(self, conn: asyncpg.Connection) -> datetime:
        """The database's time (the rows' clock), the node's skew from it logged."""
        now = self.db_clock() if self.db_clock is not None else await repo.db_now(conn)
        node = self.clock()
        if abs(node - now) > CLOCK_SKEW_WARN:
            log.warning(
                "maintenance_clock_skew",
                node_time=node.isoformat(),
                database_time=now.isoformat(),
                note="retention measures age on the database's clock; fix this node's clock",
            )
        return now

    async def _dependents(
        self, conn: asyncpg.Connection, now: datetime, report: PassReport, r: RetentionConfig
    ) -> None:
        """What goes with the walked tables' rows: consumer records, notification groups left
        without deliveries, AI payloads (under the pass's settings ``r``)."""
        if r.notify_days:
            report.deleted["notify_group"] = await repo.prune_notify_groups(
                conn, now - timedelta(days=r.notify_days), chunk=self.chunk_rows
            )
        if r.outbox_days:
            report.deleted["consumed_event"] = await repo.prune_consumed(
                conn, now - timedelta(days=r.outbox_days), chunk=self.chunk_rows
            )
        if r.ai_payload_days:
            report.deleted["ai_task_payloads"] = await repo.prune_ai_payloads(
                conn, now - timedelta(days=r.ai_payload_days), now, chunk=self.chunk_rows
            )

    async def _pass(self, conn: asyncpg.Connection, now: datetime) -> PassReport:
        r = self.retention  # the whole pass under one setting, whatever a reload does meanwhile
        report = PassReport(ran=True)
        began = asyncio.get_running_loop().time()  # monotonic: ``now`` + the pass's length
        for day in days_ahead(now, r.partitions_ahead_days):
            if await self._partition(repo.add_day_partition, conn, day):
                report.created.append(day)
        if r.telemetry_days:
            cutoff = telemetry_cutoff(now, r.telemetry_days)
            for day in await repo.day_partitions(conn):
                # A partition's samples received since the cut-off stay (a device clock far
                # behind dates them into an old day): never dropped sooner than the window
                # after they arrived.
                if day_start(day) < cutoff and await self._partition(
                    functools.partial(repo.drop_day_partition, received_before=cutoff),
                    conn,
                    day,
                ):
                    report.dropped.append(day)
            report.deleted["telemetry_default"] = await repo.prune_default_partition(
                conn, cutoff, pages=self.default_partition_pages
            )
        walked = {
            "dead_letter": r.dead_letter_days,
            "alarm_audit": r.audit_days,
            "command_audit": r.audit_days,
            "dead_letter_audit": r.audit_days,
            "command_receipt": r.receipts_days,
            "outbox_event": r.outbox_days,
            "outbox_event_dead": r.outbox_dead_days,
            "notify_delivery": r.notify_days,
        }
        for table, days in walked.items():
            if days:
                report.deleted[table] = await repo.prune_walked(
                    conn, table, now - timedelta(days=days), chunk=self.chunk_rows
                )
        await self._dependents(conn, now, report, r)
        # Not a retention setting: an expired ticket is of no use to anyone.
        tickets = await repo.prune_stream_tickets(conn, chunk=self.chunk_rows)
        if tickets:
            report.deleted["stream_ticket"] = tickets
        hearing = await repo.prune_command_hearing(
            conn, now - COMMAND_HEARING_KEEP, chunk=self.chunk_rows
        )
        if hearing:
            report.deleted["command_hearing"] = hearing
        await self._measure(conn)
        for table, n in report.deleted.items():
            if n:
                self.retention_metrics.retention_deleted.labels(table).inc(n)
        self.retention_metrics.retention_partitions_dropped.inc(len(report.dropped))
        # On the database's clock, as the pass's ``now``: a node booted at 1970 (no RTC, NTP
        # not synced yet) said its last pass was then, and one a year ahead kept the maximum
        # over the nodes a year ahead, whatever became of maintenance.
        elapsed = asyncio.get_running_loop().time() - began
        self.retention_metrics.maintenance_last_pass.set(now.timestamp() + elapsed)
        return report

    async def _partition(
        self,
        change: Callable[..., Awaitable[bool]],
        conn: asyncpg.Connection,
        day: date,
    ) -> bool:
        """Make or drop a day partition; a lock not granted in time (a long query on
        telemetry) skips it until the next pass, and the rest of this pass goes on. So does a
        change cut off (cancelled, or past its own time bound): the pruning after it must not
        wait on it."""
        action = getattr(change, "func", change).__name__
        try:
            return await change(conn, day, lock_timeout=self.partition_lock_timeout)
        except asyncpg.LockNotAvailableError:
            log.warning(
                "maintenance_partition_deferred",
                day=day.isoformat(),
                action=action,
                reason=f"its lock was not granted within {self.partition_lock_timeout}",
            )
            return False
        except (TimeoutError, asyncpg.QueryCanceledError) as exc:
            log.error(
                "maintenance_partition_failed",
                day=day.isoformat(),
                action=action,
                error=repr(exc),
                note="rolled back; tried again at the next pass, the rest of this one goes on",
            )
            return False

    async def _measure(self, conn: asyncpg.Connection) -> None:
        for size in await repo.table_sizes(conn, MEASURED_TABLES):
            self.retention_metrics.table_rows.labels(size.name).set(size.estimated_rows)
            self.retention_metrics.table_bytes.labels(size.name).set(size.bytes)
        oldest = await repo.oldest_telemetry_day(conn)
        # No telemetry at all: NaN, "no value", rather than a day that never was.
        self.retention_metrics.telemetry_oldest_day.set(
            day_start(oldest).timestamp() if oldest is not None else float("nan")
        )
