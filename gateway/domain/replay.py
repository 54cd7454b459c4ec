"""One node reading a recorded stream in order: the alarms a rule set raises on it.

``gateway rules replay`` prints them (a dry run of rules on recorded telemetry), and the field
simulation (``gateway-sim field``) uses it as its reference model: what real daemons decided,
several nodes, faults and all, must equal what this gives on each device's stream in its true
order (docs/field-simulation.md).

It applies `evaluate` with the time model (each message judged against its receipt, as the
daemon judges it), the hold timer (`fire_held`, run before each message and at the end, on
the receipt clock), and the alarm rules the storage layer applies to what they decide: a
firing supersedes the active alarm of its rule and device (nobody attends here), a clearing
clears it, a late firing is created superseded by the alarm raised since while that one is
open, else on its own, and a late clearing clears the newest alarm raised by then. Inactivity
is not modelled: it is a matter of silence on the database's clock, not of a stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

from gateway.domain.rules import (
    Clearing,
    DeviceClock,
    Firing,
    RuleSet,
    RuleState,
    SlotKey,
    ThresholdRule,
    evaluate,
    fire_held,
    hold_due_at,
    state_keys,
)
from protocol import Telemetry, telemetry_event_id


@dataclass(frozen=True)
class Received:
    """One message as the gateway received it: whose, when (the receipt) and what."""

    device_id: str
    received_at: datetime
    message: Telemetry


@dataclass
class ReplayedAlarm:
    """An alarm as the rules leave it: never attended (nobody confirms in a replay)."""

    rule_key: str
    device_id: str
    telemetry_event_id: str  # the message that raised it (or the hold timer's stand-in id)
    severity: str
    sample_ts: datetime  # the time it was judged at, as its trigger keeps it
    superseded_by: str | None = None  # the telemetry event id of the alarm that replaced it
    clear_event_id: str | None = None
    late: bool = False
    # A hold timer's alarm: the start of the run of violations it held (its trigger's).
    pending_since: datetime | None = None
    order: int = 0  # creation order, which breaks ties between alarms of one sample time

    @property
    def status(self) -> str:
        return "SUPERSEDED" if self.superseded_by is not None else "OPEN"

    def as_json(self) -> dict[str, object]:
        return {
            "rule_key": self.rule_key,
            "device_id": self.device_id,
            "telemetry_event_id": self.telemetry_event_id,
            "severity": self.severity,
            "sample_ts": self.sample_ts.isoformat(),
            "status": self.status,
            "superseded_by": self.superseded_by,
            "clear_event_id": self.clear_event_id,
            "late": self.late,
            "pending_since": None if self.pending_since is None else self.pending_since.isoformat(),
        }


@dataclass
class Replay:
    """The state one node keeps between messages: rule states, when each was last written
    (the hold timer's clock), and the alarms so far."""

    rules: RuleSet
    clock: DeviceClock = field(default_factory=DeviceClock)
    states: dict[SlotKey, RuleState] = field(default_factory=dict)
    written_at: dict[SlotKey, datetime] = field(default_factory=dict)
    alarms: list[ReplayedAlarm] = field(default_factory=list)
    _by_key: dict[tuple[str, str, str], ReplayedAlarm] = field(default_factory=dict)
    _active: dict[SlotKey, ReplayedAlarm] = field(default_factory=dict)

    def receive(self, item: Received) -> None:
        """Judge one message at its receipt (after the holds due by then)."""
        self.advance(item.received_at)
        message = item.message
        event_id = telemetry_event_id(item.device_id, message)
        keys = state_keys(self.rules, item.device_id, message)
        before = {key: self.states.get(key) for key in keys}
        evaluation = evaluate(
            self.rules,
            self.states,
            item.device_id,
            event_id,
            message,
            received_at=item.received_at,
            clock=self.clock,
        )
        for key in keys:
            if self.states.get(key) != before[key]:
                self.written_at[key] = item.received_at
        for outcome in evaluation.outcomes:
            if isinstance(outcome, Firing):
                self._fire(outcome)
            else:
                self._clear(outcome)

    def advance(self, now: datetime) -> None:
        """Run the hold timer at `now`: fire every pending violation whose hold has passed."""
        for key, state in sorted(self.states.items()):
            rule = self.rules.by_key(key[1])
            if not isinstance(rule, ThresholdRule):
                continue
            written = self.written_at.get(key)
            if written is None or hold_due_at(rule, state, written) is None:
                continue
            held = fire_held(rule, key[0], state, written_at=written, now=now)
            if held is None:
                continue
            firing, fired = held
            self.states[key] = fired
            self.written_at[key] = now
            self._fire(firing)

    def _fire(self, firing: Firing) -> None:
        dedup = (firing.rule_key, firing.device_id, firing.telemetry_event_id)
        if dedup in self._by_key:
            return
        slot = (firing.device_id, firing.rule_key)
        if firing.superseded_by_event is not None:
            successor = self._by_key.get(
                (firing.rule_key, firing.device_id, firing.superseded_by_event)
            )
            if successor is not None and successor.superseded_by is None:
                alarm = self._new(firing, late=True)
                alarm.superseded_by = firing.superseded_by_event
                alarm.clear_event_id = firing.cleared_by_event
                return
            # The alarm that would stand for it has ended: raised on its own (never hidden).
            self._raise(slot, self._new(firing, late=True))
            return
        self._raise(slot, self._new(firing, late=False))

    def _raise(self, slot: SlotKey, alarm: ReplayedAlarm) -> None:
        active = self._active.get(slot)
        if active is not None:
            active.superseded_by = alarm.telemetry_event_id
        self._active[slot] = alarm

    def _new(self, firing: Firing, *, late: bool) -> ReplayedAlarm:
        trigger = firing.trigger or {}
        sample = trigger.get("sample_ts")
        since = trigger.get("pending_since")
        alarm = ReplayedAlarm(
            rule_key=firing.rule_key,
            device_id=firing.device_id,
            telemetry_event_id=firing.telemetry_event_id,
            severity=firing.severity,
            sample_ts=datetime.fromisoformat(sample) if sample else firing.observed_at,
            late=late,
            pending_since=datetime.fromisoformat(since) if since else None,
            order=len(self.alarms),
        )
        self.alarms.append(alarm)
        self._by_key[(alarm.rule_key, alarm.device_id, alarm.telemetry_event_id)] = alarm
        return alarm

    def _clear(self, clearing: Clearing) -> None:
        slot = (clearing.device_id, clearing.rule_key)
        if clearing.raised_by_then is None:
            target = self._active.get(slot)
        else:
            by_then = clearing.raised_by_then
            candidates = [
                a
                for a in self.alarms
                if (a.device_id, a.rule_key) == slot and a.sample_ts <= by_then
            ]
            target = max(candidates, key=lambda a: (a.sample_ts, a.order), default=None)
        if target is not None and target.clear_event_id is None:
            target.clear_event_id = clearing.telemetry_event_id


def replay(
    rules: RuleSet,
    stream: Iterable[Received],
    *,
    clock: DeviceClock | None = None,
    until: datetime | None = None,
) -> list[ReplayedAlarm]:
    """The alarms `rules` raise on `stream` read in order by one node, with the hold timer
    run up to `until` at the end (if given).

    Each device is replayed on its own, in the order `stream` gives its messages: devices
    share no rule state, and a device's hold timer is advanced by its own receipts only (the
    stream need not interleave devices by receipt)."""
    alarms: list[ReplayedAlarm] = []
    for _device, items in by_device(stream):
        model = Replay(rules, clock or DeviceClock())
        for item in items:
            model.receive(item)
        if until is not None:
            model.advance(until)
        alarms += model.alarms
    return alarms


def by_device(stream: Iterable[Received]) -> Iterator[tuple[str, list[Received]]]:
    """`stream` split per device, each in its given order (devices share no rule state)."""
    devices: dict[str, list[Received]] = {}
    for item in stream:
        devices.setdefault(item.device_id, []).append(item)
    yield from devices.items()
