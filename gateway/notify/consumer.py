"""The idempotent consumer: outbox events become deliveries, exactly once, on any node.

A pass:

1. Read the consumer's horizon and ``running``, the oldest transaction still running now.
   Every transaction older than ``running`` has finished, so whatever it wrote is visible to
   the statements that follow.
2. Scan the events written by transactions at or after the horizon that this consumer has not
   consumed yet (``consumed_event``), oldest first. An event whose transaction committed late
   (after a later event's) is still there: the horizon cannot pass a transaction that was
   running, so it is found by a later pass.
3. In one transaction: record the events in ``consumed_event`` (``ON CONFLICT DO NOTHING``;
   a racing node's insert of the same event waits for ours and then finds it taken) and create
   the deliveries of exactly the events recorded now. Routes pick the receivers; an active
   silence makes the delivery ``SILENCED`` (visible, never sent), an alarm shelved when the
   event was written, or raised while its device was out of service, ``SUPPRESSED`` (visible,
   never sent, with why; the shelves that suppress held, shared, until the transaction ends,
   and what the end of one that ended already owes settled here:
   gateway.alarms.shelving.tell_returned); an open alarm matching an inhibition rule
   ``INHIBITED``; a grouped route's go into their group's window (gateway.notify.groups).
   Quiet hours are decided once per alarm (gateway.alarms.delivery.hold: a new alarm of this
   batch not decided on yet, inside quiet hours, goes DELAYED first); a delivery of an alarm
   that is DELAYED is held until the wake (gateway.alarms.timers) releases it.
4. Move the horizon to ``running``, or to the oldest transaction below it whose event is still
   unconsumed (a batch that was full), never backwards.

Only the outbox event types some route may turn into a notification are read; the rest never
become deliveries, so they are not recorded either, and the horizon moves past them. With no
route at all a pass only moves the horizon. As with the deliveries themselves, the node that reads
an event first decides with its own routes.

Progress lives in ``notify_consumer``, not in outbox rows: pruning published events later
changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Any

import asyncpg
import msgspec
import structlog

from gateway.alarms.delivery import hold
from gateway.alarms.shelving import tell_returned
from gateway.domain.alarm import AlarmStatus
from gateway.domain.notify import (
    ALARM_CREATED,
    Notify,
    alarm_link,
    first_silence,
    notification_of,
    silence_from_row,
)
from gateway.domain.notify_match import Facts
from gateway.domain.notify_policy import facts_of_alarm, inhibitor, source_rule_keys
from gateway.domain.quiet_hours import QuietHours
from gateway.notify.groups import GroupWindows, Pending
from gateway.notify.metrics import NotifyMetrics
from gateway.support.loops import drain_on_notify
from protocol.events import CommandFinished, EventPayload, decode_payload
from storage import notify as repo
from storage.notify import NewDelivery, OutboxRow

log = structlog.get_logger(__name__)

CONSUMER = "notify"
# A held delivery's due time when this node's quiet hours do not say when its alarm wakes.
HELD_FALLBACK_S = 86400.0
OUTBOX_CHANNEL = "outbox_event"


class NotifyConsumer:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        dsn: str,
        metrics: NotifyMetrics,
        rules: Notify,
        public_url: str = "",
        quiet: QuietHours | None = None,
        batch: int = 100,
        poll_s: float = 1.0,
        on_created: Callable[[], None] | None = None,
        consumer: str = CONSUMER,
        node_id: str = "",
    ) -> None:
        self.node_id = node_id  # the audit rows of the quiet-hours decisions it takes
        self.pool = pool
        self.dsn = dsn
        self.metrics = metrics
        self.rules = rules
        self.public_url = public_url
        self.quiet = quiet
        # Both reloaded (SIGHUP): the next pass takes them, and the wait under way ends
        # (``wakeup``). They used to be the start's for the process's life.
        self.batch = batch
        self.poll_s = poll_s
        self.wakeup = asyncio.Event()
        self.on_created = on_created
        self.consumer = consumer
        self._ensured = False  # its notify_consumer row exists (made once per process)
        # The rules whose intervals the stored groups were given (GroupWindows.retime): done
        # once after the start and after each reload, which replaces ``rules``.
        self._retimed: Notify | None = None

    async def run(self, stop: asyncio.Event) -> None:
        await drain_on_notify(
            dsn=self.dsn,
            channel=OUTBOX_CHANNEL,
            stop=stop,
            step=self.run_once,
            poll_s=lambda: self.poll_s,  # a reload may change it
            name="notify-consumer",
            wakeup=self.wakeup,
        )

    def reconfigure(self, *, batch: int, poll_s: float) -> None:
        """A reload: ``[notify] batch`` and ``poll_s`` from the next pass, which starts now."""
        self.batch = batch
        self.poll_s = poll_s
        self.wakeup.set()

    async def run_once(self) -> int:
        """One pass; the number of events this pass consumed (0: nothing new)."""
        # Only the event types some route may send are read (and recorded as consumed); with
        # no route at all the horizon just moves on. A route added by a reload applies to
        # events written after the horizon has passed: none are sent from before it.
        types = sorted(self.rules.outbox_types())
        async with self.pool.acquire() as conn:
            if not self._ensured:
                await repo.ensure_consumer(conn, self.consumer)
                self._ensured = True
            rules = self.rules
            if self._retimed is not rules:
                retimed = await GroupWindows(conn).retime(rules.routes)
                if retimed:
                    log.info("notify_groups_retimed", groups=retimed)
                self._retimed = rules
            if not types:  # one statement a pass: nothing is read
                await repo.skip_horizon(conn, self.consumer)
                return 0
            # Repeats only while some route groups (a reload dropping grouping ends them).
            grouping = any(route.grouping is not None for route in self.rules.routes)
            repeated = await GroupWindows(conn).repeat(self.rules.routes) if grouping else 0
            horizon = await repo.read_horizon(conn, self.consumer)
            rows = await repo.scan_unconsumed(
                conn, self.consumer, horizon.horizon, self.batch, types
            )
            consumed = 0
            if rows:
                consumed = await self._consume(conn, rows)
            await repo.advance_horizon(conn, self.consumer, horizon.running, types)
        if (consumed or repeated) and self.on_created is not None:
            self.on_created()
        # A full batch means there may be more; a pass that found only events another node
        # consumed first is not progress of ours, but the scan moves on once they commit.
        return consumed or (len(rows) if len(rows) >= self.batch else 0)

    async def _consume(self, conn: asyncpg.Connection, rows: list[OutboxRow]) -> int:
        rules = self.rules  # one configuration for the whole pass, whatever a reload does
        async with conn.transaction():
            taken = await repo.consume_events(conn, self.consumer, [r.event_id for r in rows])
            if not taken:
                return 0
            mine = [r for r in rows if r.event_id in taken]
            events = {r.event_id: _decoded(r) for r in mine}
            facts = {r.event_id: _notification(r.event_type, events[r.event_id]) for r in mine}
            alarm_ids = sorted({f.alarm_id for f in facts.values() if f and f.alarm_id})
            now = await repo.db_now(conn)
            # Suppressions first (their shelves locked, share), then quiet hours (alarm rows
            # locked): a shelf's end, which writes audit rows on its alarms, waits for this
            # transaction, never the other way round too.
            suppressed, shelves = await self._suppressed(conn, mine, facts)
            ended = await repo.lock_ended_shelves(conn, shelves)
            # Settled below, after any other end over the same pairs (their order: shelves,
            # then these locks, then alarms and groups, as a lift or an expiry takes them).
            await repo.hold_shelf_ends(conn, ended)
            await self._hold(conn, [f for f in facts.values() if f is not None], now)
            alarms = await repo.alarm_facts(conn, alarm_ids) if alarm_ids else {}
            silences = [silence_from_row(s) for s in await repo.active_silences(conn)]
            sources = await self._inhibition_sources(conn, rules)
            deliveries: list[NewDelivery] = []
            grouped: list[Pending] = []
            for row in mine:
                fact = facts[row.event_id]
                if fact is None:
                    continue
                alarm = alarms.get(fact.alarm_id) if fact.alarm_id is not None else None
                fact = _with_alarm(fact, alarm)
                targets = rules.targets(fact)
                if not targets:
                    continue
                silence = first_silence(silences, fact, now)
                inhibited = inhibitor(rules.inhibit, fact, sources, rules.sites)
                body = self._body(row, fact, events[row.event_id], alarm)
                held = alarm is not None and alarm["status"] == AlarmStatus.DELAYED.value
                due_in_s = self._held_for(fact, now) if held else 0.0
                why = (
                    None
                    if silence is not None
                    else suppressed.get(row.event_id) or taken_while_held(alarm, row.created_at)
                )
                # Silenced, inhibited or suppressed: a final delivery of its own, in no window.
                held_back = silence is not None or inhibited is not None or why is not None
                for name, route in targets:
                    if route.grouping is not None and not held_back:
                        grouped.append(Pending(row=row, fact=fact, body=body, receiver=name,
                                               route=route,
                                               held_for_s=due_in_s if held else None))  # fmt: skip
                        continue
                    deliveries.append(
                        NewDelivery(
                            event_id=row.event_id,
                            outbox_id=row.id,
                            event=fact.event,
                            receiver=name,
                            body=body,
                            alarm_id=fact.alarm_id,
                            device_id=fact.device_id,
                            rule_key=fact.rule_key,
                            severity=fact.severity,
                            silence_id=None if silence is None else silence.id,
                            due_in_s=due_in_s,
                            event_created_at=row.created_at,
                            inhibited_by=None if inhibited is None else inhibited[1].alarm_id,
                            inhibit_rule=None if inhibited is None else inhibited[0].name,
                            suppressed=why,
                            route_grouped=route.grouping is not None,
                        )
                    )
            created = await repo.insert_deliveries(conn, deliveries)
            windows = await GroupWindows(conn).add(grouped, rules.sites, now)
            # A shelf that suppressed some of these but ended before this transaction locked
            # it (this consumer was behind): its end could not see them, so what it owes the
            # ungrouped routes is settled here (once: the returns' ids are the shelf's and
            # the alarm's, and deliveries are unique per id and receiver).
            for shelf in ended:
                await tell_returned(conn, shelf)
        self.metrics.events_consumed.inc(len(mine))
        for record in created:
            if record["status"] in ("SILENCED", "INHIBITED", "SUPPRESSED"):
                self.metrics.deliveries.labels(record["receiver"], record["status"]).inc()
        if created or grouped:
            log.info(
                "notify_deliveries_created",
                events=len(mine),
                deliveries=len(created),
                grouped=len(grouped),
                windows_opened=windows,
            )
        return len(mine)

    @staticmethod
    async def _suppressed(
        conn: asyncpg.Connection, rows: list[OutboxRow], facts: dict[Any, Facts | None]
    ) -> tuple[dict[Any, str], list[int]]:
        """Why each alarm event's notifications are suppressed, by event id: its alarm was
        shelved when the event was written, or was raised while its device was out of service
        (one statement for the batch); and the shelves that suppress some."""
        asked = [
            (row.event_id, fact.alarm_id, row.created_at)
            for row in rows
            if (fact := facts[row.event_id]) is not None
            and fact.alarm_id is not None
            and fact.event.startswith("alarm.")
        ]
        reasons = await repo.alarm_suppressions_by(conn, [(a, at) for _, a, at in asked])
        whys = {
            event_id: why
            for (event_id, _, _), (why, _) in zip(asked, reasons, strict=True)
            if why is not None
        }
        return whys, sorted({shelf for _, shelf in reasons if shelf is not None})

    async def _inhibition_sources(self, conn: asyncpg.Connection, rules: Notify) -> list[Facts]:
        """The open alarms that may inhibit (those of the rules' source rule keys)."""
        keys = source_rule_keys(rules.inhibit)
        if not keys:
            return []
        return [facts_of_alarm(r) for r in await repo.open_alarms_of_rules(conn, keys)]

    async def _hold(self, conn: asyncpg.Connection, facts: list[Facts], now: datetime) -> None:
        """Quiet hours, decided once per alarm (gateway.alarms.delivery.hold): the new alarms
        of these events that nobody decided on yet, inside quiet hours, go DELAYED now, before
        their notifications are made; those notifications are then held until the wake."""
        quiet = self.quiet
        if quiet is None:
            return
        new = sorted({f.alarm_id for f in facts if f.event == ALARM_CREATED and f.alarm_id})
        for alarm_id in new:  # in id order: two consumers never wait on each other in a circle
            await hold(conn, alarm_id, quiet=quiet, node_id=self.node_id, now=now,
                       deliveries_made=True)  # fmt: skip

    def _held_for(self, fact: Facts, now: datetime) -> float:
        """Seconds a held delivery is expected to wait: until this node's quiet hours end (or,
        if this node would not hold the alarm, a day). Only an estimate shown with it: the
        claim takes no delivery of a DELAYED alarm, and the wake makes them due at once."""
        quiet = self.quiet
        until = None
        if quiet is not None and fact.device_id is not None and fact.severity is not None:
            until = quiet.quiet_until(device_id=fact.device_id, severity=fact.severity, at=now)
        return HELD_FALLBACK_S if until is None else max(0.0, (until - now).total_seconds())

    def _body(
        self,
        row: OutboxRow,
        fact: Facts,
        event: EventPayload | None,
        alarm: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """What a receiver gets: the event's payload as it is, with the alarm's device,
        status and times as they are now, and the console's link."""
        body: dict[str, Any] = {
            "event_id": str(row.event_id),
            "event": fact.event,
            "source_event": row.event_type,
            "occurred_at": row.created_at.isoformat(),
            "device_id": fact.device_id,
            "rule_key": fact.rule_key,
            "severity": fact.severity,
            "alarm_id": fact.alarm_id,
            "status": None,
            "link": alarm_link(self.public_url, fact.alarm_id),
            "payload": msgspec.Raw(row.payload.encode()),  # as written
        }
        if alarm is not None:
            body["status"] = alarm["status"]
            body["times"] = {
                key: value.isoformat()
                for key, value in alarm.items()
                if key.endswith("_at") and isinstance(value, datetime)
            }
        elif isinstance(event, CommandFinished):
            body["status"] = event.command.get("status")
        return body


def _decoded(row: OutboxRow) -> EventPayload | None:
    """The event's payload as its type's Struct; None, logged, for one not of its schema (a
    row no route can make a notification of, rather than a consumer stuck on it)."""
    try:
        return decode_payload(row.event_type, row.payload)
    except (ValueError, msgspec.ValidationError) as exc:
        log.warning(
            "notify_event_undecodable",
            event_id=str(row.event_id),
            type=row.event_type,
            error=str(exc),
        )
        return None


def _notification(event_type: str, event: EventPayload | None) -> Facts | None:
    return None if event is None else notification_of(event_type, event)


def taken_while_held(alarm: dict[str, Any] | None, written_at: datetime) -> str | None:
    """Why a notification of an alarm event written at ``written_at`` is not sent: the alarm
    was DELAYED by quiet hours then and left DELAYED by another step than its wake, a person
    confirming or handling it or a newer firing superseding it, before this consumer read the
    event (it was behind). Its deliveries would have been held, and that step would have
    suppressed them (gateway.alarms.held): they are made SUPPRESSED so, naming the step.
    None for anything else."""
    if alarm is None or alarm["quiet_delayed"] is None:
        return None
    delayed = alarm["quiet_delayed"]
    woken = alarm["quiet_woken"]
    if woken is not None and (woken >= delayed or written_at < woken):
        return None  # woken since (released), or written before an earlier wake (released)
    step = _step_out_of_delay(alarm, delayed)
    if step is None or written_at >= step[0]:
        return None  # still held, or written once it no longer was: told as it comes
    return step[1]


def _step_out_of_delay(alarm: dict[str, Any], delayed: datetime) -> tuple[datetime, str] | None:
    """The first step since ``delayed`` that took the alarm out of DELAYED other than its
    wake, when, and what it was (as gateway.alarms.held names it); None if none has."""
    steps = [
        (at, why)
        for at, why in (
            (alarm["confirmed_at"], f"confirmed in quiet hours by {alarm['confirmed_by']}"),
            (alarm["handled_at"], f"handled in quiet hours by {alarm['handled_by']}"),
            (
                alarm["quiet_superseded"],
                f"superseded in quiet hours by alarm {alarm['superseded_by']}",
            ),
        )
        if at is not None and at >= delayed
    ]
    return min(steps, key=lambda step: step[0]) if steps else None


def _with_alarm(fact: Facts, alarm: dict[str, Any] | None) -> Facts:
    """The alarm's own device, rule and severity where the event did not carry them."""
    if alarm is None:
        return fact
    return Facts(
        event=fact.event,
        device_id=fact.device_id or alarm["device_id"],
        rule_key=fact.rule_key or alarm["rule_key"],
        severity=fact.severity or alarm["severity"],
        alarm_id=fact.alarm_id,
    )
