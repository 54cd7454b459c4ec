"""Inactivity alarms: devices not heard from for ``silent_seconds`` (or offline).

Derived from ``device.last_seen`` / presence in the database, not from timers, so the
decision survives restarts and is the same on every node: the dedup key of the alarm is
computed from the stored silence, and whoever commits first raises it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

import asyncpg
import structlog

from gateway.alarms.engine import AlarmEngine, inactivity_event_id
from gateway.alarms.lifecycle import create_alarm
from gateway.domain.errors import ConcurrentWriteError
from gateway.domain.rules import InactivityRule, RuleSet, silence_trigger
from gateway.support.hearing import ALWAYS, Hearing, will_windows
from gateway.support.loops import every_while_configured
from storage import alarms as repo

log = structlog.get_logger(__name__)

# Seconds a node listens after (re)subscribing before it judges silence: what devices held
# while the broker was away, and what its session kept, arrives first. A Will `offline` read
# within that long of a break (before, during or after it; at a start, while the node
# subscribed) is no statement of the device's death (`will_windows`); such a device is judged
# by its silence.
REHEAR_S = 10.0


def pass_interval_s(rules: RuleSet) -> float | None:
    """Seconds between passes for `rules`: a quarter of the shortest silence, 1 to 30 s; None
    without inactivity rules (the monitor then idles until a reload brings some)."""
    inactivity = rules.inactivity_rules
    if not inactivity:
        return None
    silent = min(rule.silent_seconds for rule in inactivity)
    return min(max(silent / 4, 1.0), 30.0)


class InactivityMonitor:
    """Runs on every node, with or without inactivity rules: a reload may add the first one
    (or remove the last), and `rules_replaced` makes the next pass follow it at once."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        engine: AlarmEngine,
        interval_s: float | None = None,
        hearing: Callable[[float], Hearing] | None = None,
        confirm: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.pool = pool
        self.engine = engine
        self.interval_s = interval_s  # None: from the rules (`pass_interval_s`)
        # What this node's broker session heard (given the longest silence it must answer
        # for): how long it has been subscribed without a break and its breaks, the first
        # from before its first subscribe; None: always listening (a monitor built without a
        # session). Silence counts only while someone listens: a device is silent when this
        # node listened for `silent_seconds` since its last_seen, breaks left out (every
        # device would look silent after an outage, an alarm flood); while the broker is away
        # nothing is judged, and after a break the devices get `REHEAR_S` to be heard. What
        # the node received and has not stored yet is not heard yet: from the oldest such
        # message's receipt on is a break too (the session's hearing asks the writer).
        self.hearing = hearing
        # Asked before each pass reads ``hearing``: the session asks the broker for an answer,
        # so that a link stalled without closing (seen by the keep-alive only 1.5 intervals
        # later) is not taken for listening while it swallows every device's reports.
        self.confirm = confirm
        # Seconds until the last pass's node will have listened long enough (None: it had).
        self._deaf_for_s: float | None = None
        self._wakeup = asyncio.Event()

    def rules_replaced(self) -> None:
        """A reload swapped the engine's rules: look at them now, not after the old interval."""
        self._wakeup.set()

    def current_interval_s(self) -> float | None:
        rules = self.engine.rules
        if not rules.inactivity_rules:
            return None
        interval = pass_interval_s(rules) if self.interval_s is None else self.interval_s
        deaf_for = self._deaf_for_s
        if deaf_for is not None and interval is not None:
            # The last pass could not judge silence yet: look again once it can.
            return min(interval, max(deaf_for, 0.2))
        return interval

    async def run(self, stop: asyncio.Event) -> None:
        await every_while_configured(
            self.current_interval_s, stop, self.run_once, wakeup=self._wakeup, name="inactivity"
        )

    async def run_once(self) -> list[int]:
        """Raise the inactivity alarms due now; the ids raised by this call."""
        raised: list[int] = []
        rules = self.engine.rules.inactivity_rules
        if not rules:
            return raised
        longest = max(rule.silent_seconds for rule in rules)
        if self.hearing is not None and self.confirm is not None:
            await self.confirm()
        configured = [rule.key for rule in rules]
        self._deaf_for_s = None
        for rule in rules:
            # Page by page (by device id): a fleet that churns ids leaves rows that never
            # speak again, and those the rule's selector leaves out come back at every pass.
            after = ""
            while True:
                async with self.pool.acquire() as conn:
                    # Read at the last moment before the query, once the connection is had:
                    # the wait for it (a busy pool), or the rules (or pages) before this one,
                    # may have outlasted the session. Read before them, the break its loss
                    # began was not left out, and a device whose reports waited at the broker
                    # was alarmed silent.
                    heard = ALWAYS if self.hearing is None else self.hearing(longest)
                    listening = heard.listening_s
                    began = [b for b, _ in heard.breaks]
                    ended = [e for _, e in heard.breaks]
                    unsaid = will_windows(heard, REHEAR_S)
                    needed = min(rule.silent_seconds, REHEAR_S)
                    deaf = listening < needed
                    if deaf:
                        wait = needed - listening
                        self._deaf_for_s = min(wait, self._deaf_for_s or wait)
                    silent = await repo.silent_devices(
                        conn,
                        rule.silent_seconds,
                        rule.key,
                        breaks_began=began,
                        breaks_ended=ended,
                        configured=configured,
                        will_windows=unsaid,
                        after=after,
                    )
                for device in silent:
                    device_id = device["device_id"]
                    if not rule.selector.matches(device_id):
                        continue
                    since = device["last_seen"]
                    if device["stated"]:
                        since = device["presence_at"]
                        reason = "presence offline"
                    elif deaf or not device["silent"]:
                        # Not heard, but not listened to for long enough either; or a Will
                        # read about a break of the session, the device not silent (yet).
                        continue
                    else:
                        reason = f"silent for more than {rule.silent_seconds:g}s"
                    alarm_id = await self._raise(
                        rule,
                        device_id,
                        since,
                        reason,
                        last_seen=device["last_seen"],
                        configured=configured,
                    )
                    if alarm_id is not None:
                        raised.append(alarm_id)
                if len(silent) < repo.SILENT_PAGE:
                    break
                after = silent[-1]["device_id"]
        return raised

    async def _raise(
        self,
        rule: InactivityRule,
        device_id: str,
        since: datetime,
        reason: str,
        *,
        last_seen: datetime,
        configured: Sequence[str],
    ) -> int | None:
        rule_key = rule.key
        event_id = inactivity_event_id(rule_key, device_id, since)
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                # Heard from since the pass read its silence (a pass raising many alarms takes
                # seconds), its message stored and its alarms cleared before this one existed:
                # no alarm, nothing would clear it until the device's next message. The row
                # stays locked: a batch storing a message now waits, then clears this alarm.
                if not await repo.lock_unheard(conn, device_id, last_seen):
                    return None
                now = await repo.db_now(conn)
                creation = await create_alarm(
                    conn,
                    device_id=device_id,
                    rule_key=rule_key,
                    severity=rule.severity,
                    telemetry_event_id=event_id,
                    reason=reason,
                    node_id=self.engine.node_id,
                    now=now,
                    summary=self.engine.summary,
                    trigger=silence_trigger(since, configured),
                    rule_description=rule.description,
                )
        except ConcurrentWriteError:
            return None  # another node raised it first
        if creation.alarm is None:
            return None
        self.engine.alarm_metrics.alarms_created.labels(rule_key).inc()
        log.info("alarm_created", alarm_id=creation.alarm.id, rule_key=rule_key, reason=reason)
        return creation.alarm.id
