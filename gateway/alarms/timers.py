"""Time-driven alarm transitions: quiet hours, escalation, reminders; and unreached alarms.

Every decision is derived from stored times and made by a conditional write, so the timers
run on every node, survive restarts, and never act twice: two nodes that decide the same
thing at once race on ``WHERE status = $expected``, and one of them finds nothing to do.

Quiet hours are looked at on every pass, configured or not: a reload that removes or moves a
window wakes the alarms it held (none left means nothing holds them). The wake also releases,
in the same transaction, the notifications the consumer held while the alarm was DELAYED:
quiet hours are decided once per alarm (gateway.alarms.delivery.hold), and its notifications
follow its status, whatever each node's configuration. Inside a window no
reminder is made: the reminder due is made once, on the first pass after the window, instead
of one per interval that passed inside it.

Shelves past their until are ended here too (gateway/alarms/shelving.py).

An alarm still NEW ``unreached_after_s`` after it fired (or after its wake, when quiet hours
held it) reached nobody (docs/behaviour.md §5).
The lifecycle has no step out of NEW for that (escalation starts from CONFIRMED, and the nine
states stay as they are), so it is marked once (``unreached_at``, a conditional write), logged
as ``alarm_unreached``, counted and audited; its status stays NEW, and its reminders, if
configured, go on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import asyncpg
import structlog

from gateway.alarms import shelving
from gateway.alarms.delivery import QUIET_ACTOR
from gateway.alarms.held import suppress_held
from gateway.alarms.lifecycle import (
    AlarmNotFoundError,
    StatusChangedError,
    alarm_from_record,
    transition,
)
from gateway.alarms.metrics import AlarmMetrics
from gateway.config import AlarmsConfig
from gateway.domain.alarm import Action, AlarmStatus, next_status
from gateway.domain.quiet_hours import QuietHours, held_back
from gateway.support.loops import every
from gateway.support.metrics import Metrics
from gateway.support.node import Node
from protocol.events import Aggregate, AlarmReminder, EventType
from storage import alarms as repo
from storage import notify as notify_repo
from storage import outbox

log = structlog.get_logger(__name__)

ESCALATION_ACTOR = "system:escalation"
UNREACHED_ACTOR = "system:unreached"
BATCH = 200

Clock = Callable[[asyncpg.Connection], Awaitable[datetime]]


async def database_clock(conn: asyncpg.Connection) -> datetime:
    return await repo.db_now(conn)


@dataclass(slots=True)
class TimerReport:
    woken: list[int] = field(default_factory=list)
    escalated: list[int] = field(default_factory=list)
    reminded: list[int] = field(default_factory=list)
    unreached: list[int] = field(default_factory=list)
    released: int = 0  # notifications held while their alarm was DELAYED, made due by the wake
    # Of those, the ones the wake found shelved or out of service: SUPPRESSED instead.
    suppressed: int = 0
    unshelved: list[int] = field(default_factory=list)  # shelves this pass ended (expired)


@dataclass(frozen=True, slots=True)
class Woken:
    """A wake's held notifications: how many were made due, and the receivers of those
    suppressed (the alarm shelved, or out of service)."""

    released: int
    suppressed: list[str]


class AlarmTimers:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        node_id: str,
        quiet: QuietHours | None,
        escalate_after_s: float,
        repeat_interval_s: float,
        unreached_after_s: float = 0.0,
        interval_s: float = 5.0,
        clock: Clock = database_clock,
        metrics: Metrics | None = None,
        count_suppressed: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.node_id = node_id
        self.quiet = quiet
        self.escalate_after_s = escalate_after_s
        self.repeat_interval_s = repeat_interval_s
        self.unreached_after_s = unreached_after_s
        self.interval_s = interval_s
        self.clock = clock
        self.metrics = metrics
        self.alarm_metrics = None if metrics is None else AlarmMetrics.of(metrics.registry)
        # A held notification suppressed by the wake, by receiver: counted with the consumer's
        # (gateway_notify_deliveries_total{outcome="SUPPRESSED"}; the notify layer owns it).
        self.count_suppressed = count_suppressed

    @classmethod
    def from_config(
        cls,
        node: Node,
        alarms: AlarmsConfig,
        *,
        quiet: QuietHours | None,
        count_suppressed: Callable[[str], None] | None = None,
    ) -> AlarmTimers:
        return cls(
            pool=node.pool,
            node_id=node.node_id,
            quiet=quiet,
            escalate_after_s=alarms.escalate_after_s,
            repeat_interval_s=alarms.repeat_interval_s,
            unreached_after_s=alarms.unreached_after_s,
            interval_s=alarms.timer_interval_s,
            metrics=node.metrics,
            count_suppressed=count_suppressed,
        )

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.interval_s, stop, self.run_once, name="alarm-timers")

    async def run_once(self) -> TimerReport:
        report = TimerReport()
        async with self.pool.acquire() as conn:
            now = await self.clock(conn)
            await self._wake(conn, now, report)
            if self.escalate_after_s > 0:
                await self._escalate(conn, now, report)
            if self.repeat_interval_s > 0:
                await self._remind(conn, now, report)
            if self.unreached_after_s > 0:
                await self._unreached(conn, now, report)
            await self._expire_shelves(conn, now, report)
        return report

    async def _expire_shelves(
        self, conn: asyncpg.Connection, now: datetime, report: TimerReport
    ) -> None:
        """Shelves past their until end, at it: each once, whichever node's pass gets it (a
        conditional write; another node skips the rows this one holds, then finds them ended),
        with an ``unshelve`` audit row on each alarm they covered."""
        while True:
            async with conn.transaction():
                ended = await shelving.expire_due(conn, now, node_id=self.node_id, limit=BATCH)
            for shelf in ended:
                log.info(
                    "alarm_shelf_expired",
                    shelf_id=shelf["id"],
                    scope=shelf["scope"],
                    alarm_id=shelf["alarm_id"],
                    device_id=shelf["device_id"],
                    rule_key=shelf["rule_key"],
                )
                report.unshelved.append(int(shelf["id"]))
            if len(ended) < BATCH:
                return

    async def _unreached(
        self, conn: asyncpg.Connection, now: datetime, report: TimerReport
    ) -> None:
        after_s = self.unreached_after_s
        # NEW for that long: since it fired, or since its wake (quiet hours held it on purpose).
        new_before = now - timedelta(seconds=after_s)
        while True:
            async with conn.transaction():
                rows = await repo.mark_unreached(conn, new_before, now, BATCH)
                for row in rows:
                    await repo.insert_audit(
                        conn,
                        alarm_id=row["id"],
                        actor=UNREACHED_ACTOR,
                        stated_actor=None,
                        action="unreached",
                        from_status=AlarmStatus.NEW.value,
                        to_status=AlarmStatus.NEW.value,
                        node_id=self.node_id,
                        note=(
                            f"reached nobody within {after_s:g} s: no MQTT subscriber and no "
                            "notification receiver accepted it"
                        ),
                        request_id=None,
                        event_id=None,
                    )
            for row in rows:
                log.warning(
                    "alarm_unreached",
                    alarm_id=row["id"],
                    device_id=row["device_id"],
                    rule_key=row["rule_key"],
                    severity=row["severity"],
                    after_s=after_s,
                )
                if self.alarm_metrics is not None:
                    self.alarm_metrics.alarms_unreached.inc()
                report.unreached.append(row["id"])
            if len(rows) < BATCH:
                return

    async def _wake(self, conn: asyncpg.Connection, now: datetime, report: TimerReport) -> None:
        quiet = self.quiet  # one configuration for the whole pass, even if a reload swaps it
        after = 0
        # Every page: alarms still held fill the first ones, and must not hide those behind.
        while rows := await repo.delayed(conn, after, BATCH):
            after = rows[-1]["id"]
            for row in rows:
                if held_back(quiet, device_id=row["device_id"], severity=row["severity"], at=now):
                    continue
                # Back to NEW, and its notifications, held while it was DELAYED, due now, in
                # one transaction: publishing the wake-up event pushes it (delivery.deliver),
                # and so does a receiver accepting one of them.
                woken = await self._wake_one(conn, row, now)
                if woken is not None:
                    report.woken.append(row["id"])
                    report.released += woken.released
                    report.suppressed += len(woken.suppressed)
            if len(rows) < BATCH:
                break

    async def _escalate(self, conn: asyncpg.Connection, now: datetime, report: TimerReport) -> None:
        due = now - timedelta(seconds=self.escalate_after_s)
        for alarm_id in await repo.escalation_due(conn, due, BATCH):
            # Still due when written: another node may have escalated it since this pass read
            # it, and a person confirmed it again (its clock starts again then).
            if await self._act(
                conn,
                alarm_id,
                Action.ESCALATE,
                expected=AlarmStatus.CONFIRMED,
                now=now,
                actor=ESCALATION_ACTOR,
                event_type=EventType.ALARM_ESCALATED,
                confirmed_not_after=due,
            ):
                report.escalated.append(alarm_id)

    async def _wake_one(
        self, conn: asyncpg.Connection, row: asyncpg.Record, now: datetime
    ) -> Woken | None:
        """DELAYED → NEW and the release of its held notifications, together; what was
        released, or None if another node or a person got there first.

        A held notification is made at the wake, and judged then as the consumer judges one it
        makes: an alarm shelved now (or raised while its device was out of service) sends none,
        so its held deliveries are SUPPRESSED, not made due (docs/behaviour.md §5, Shelving);
        one in a group's window leaves the window, SUPPRESSED on its own, and the rest of the
        window goes.

        A shelf over the alarm ending at the same moment is made before or after the wake,
        never beside it (its end's pair lock, taken first, as the end takes it before its
        alarms): the end then tells what the wake suppressed, or the wake, judging after the
        end (at the later of its pass's time and the lock's), releases them."""
        alarm_id = int(row["id"])
        try:
            async with conn.transaction():
                await notify_repo.hold_shelf_ends(conn, [row])
                # The pass judged the quiet hours at `now`: an alarm delayed after that (a
                # publisher that judged a window begun since) is not this pass's to wake; the
                # next pass judges it at its own time. (A wake dated before its delay is no
                # record at all: the domain refuses it.)
                locked = await repo.lock(conn, alarm_id)
                if locked is None or (
                    locked["delayed_at"] is not None and locked["delayed_at"] > now
                ):
                    return None
                at = max(now, await repo.clock_now(conn))
                await transition(
                    conn,
                    alarm_id,
                    Action.WAKE,
                    actor=QUIET_ACTOR,
                    node_id=self.node_id,
                    expected=AlarmStatus.DELAYED,
                    now=now,
                    event_type=EventType.ALARM_WOKEN,
                )
                [why] = await notify_repo.alarm_suppressions(conn, [(alarm_id, at)])
                suppressed = [] if why is None else await suppress_held(conn, alarm_id, now, why)
                released = await repo.release_held_deliveries(conn, alarm_id, now)
        except (StatusChangedError, AlarmNotFoundError):
            return None
        log.info("alarm_timer_transition", alarm_id=alarm_id, action=Action.WAKE.value)
        if released:
            log.info("held_notifications_released", alarm_id=alarm_id, deliveries=released)
        for receiver in suppressed:
            if self.count_suppressed is not None:
                self.count_suppressed(receiver)
        if self.metrics is not None:
            self.metrics.count_alarm_transition(AlarmStatus.DELAYED.value, AlarmStatus.NEW.value)
        return Woken(released=released, suppressed=suppressed)

    async def _act(
        self,
        conn: asyncpg.Connection,
        alarm_id: int,
        action: Action,
        *,
        expected: AlarmStatus,
        now: datetime,
        actor: str,
        event_type: EventType,
        confirmed_not_after: datetime | None = None,
    ) -> bool:
        try:
            async with conn.transaction():
                await transition(
                    conn,
                    alarm_id,
                    action,
                    actor=actor,
                    node_id=self.node_id,
                    expected=expected,
                    now=now,
                    event_type=event_type,
                    confirmed_not_after=confirmed_not_after,
                )
        except (StatusChangedError, AlarmNotFoundError):
            return False  # a person or another node got there first
        log.info("alarm_timer_transition", alarm_id=alarm_id, action=action.value)
        if self.metrics is not None:
            self.metrics.count_alarm_transition(expected.value, next_status(expected, action).value)
        return True

    async def _remind(self, conn: asyncpg.Connection, now: datetime, report: TimerReport) -> None:
        due = now - timedelta(seconds=self.repeat_interval_s)
        quiet = self.quiet
        after = 0
        while rows := await repo.reminder_due(conn, due, after, BATCH):
            after = rows[-1]["id"]
            for row in rows:
                # Held, not made: the reminder stays due, and the first pass after the window
                # makes one (a reminder made now would only wait for the window's end with
                # every other one made meanwhile, and all of them would ring at once).
                if held_back(quiet, device_id=row["device_id"], severity=row["severity"], at=now):
                    continue
                if await self._remind_one(conn, row, now):
                    report.reminded.append(row["id"])
            if len(rows) < BATCH:
                break

    async def _remind_one(
        self, conn: asyncpg.Connection, row: asyncpg.Record, now: datetime
    ) -> bool:
        async with conn.transaction():
            updated = await repo.mark_reminded(
                conn, row["id"], row["status"], row["last_notified_at"], now
            )
            if updated is None:
                return False  # changed meanwhile, or another node reminded first
            alarm = alarm_from_record(updated)
            await outbox.add_event(
                conn,
                aggregate_type=Aggregate.ALARM,
                aggregate_id=str(alarm.id),
                event_type=EventType.ALARM_REMINDER,
                payload=AlarmReminder(alarm=alarm),
            )
        return True
