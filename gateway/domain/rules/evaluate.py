"""The pure evaluation engine: `evaluate` judges a message against the rules and their
states, outcomes in order; `fire_held` and `hold_due_at` are the hold timer's side."""

from __future__ import annotations

import enum
import hashlib
import math
import operator
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, TypeAlias

import msgspec

from gateway.domain.alarm import Severity
from gateway.domain.rules.model import (
    EventRule,
    InactivityRule,
    Op,
    Rule,
    RuleSet,
    ThresholdRule,
    _DeviceRules,
    _is_number,
)
from gateway.domain.rules.state import (
    IDLE,
    ClockAdjustment,
    DeviceClock,
    RuleState,
    RuleStates,
    SlotKey,
    _without_future,
    judged_time,
    replace,
    seq_order,
    state_keys,
)
from protocol import MetricValue, Telemetry

__all__ = [
    "Clearing",
    "Evaluation",
    "Firing",
    "Outcome",
    "Rejudged",
    "clears",
    "evaluate",
    "fire_held",
    "hold_due_at",
    "hold_event_id",
    "inactivity_firing",
    "judged_again",
    "rejudged_event_id",
    "silence_trigger",
    "trigger_of",
    "violates",
]


_NEGATED: Final[Mapping[Op, Op]] = {
    ">": "<=",
    ">=": "<",
    "<": ">=",
    "<=": ">",
    "==": "!=",
    "!=": "==",
}


@dataclass(frozen=True)
class Firing:
    """Raise an alarm for this sample.

    `superseded_by_event`: a late event occurrence older than the alarm raised since (by that
    telemetry event): in device order it came first, so its alarm is created already
    superseded by that one — and, with `cleared_by_event`, already cleared by the clear event
    that came between them.
    """

    rule_key: str
    severity: Severity
    device_id: str
    telemetry_event_id: str
    reason: str
    observed_at: datetime  # the message's device timestamp
    superseded_by_event: str | None = None
    cleared_by_event: str | None = None
    # Why it fired, stored with the alarm: see `trigger_of`.
    trigger: Mapping[str, Any] | None = field(default=None, compare=False)
    rule_description: str = ""


@dataclass(frozen=True)
class Clearing:
    """Clear the active alarm of (device, rule), by the sample `telemetry_event_id`.

    `raised_by_then`: a late clear, older than the alarm raised since. It clears the alarm
    that was active at its time instead — the newest raised by a sample at or before
    `raised_by_then` — if that one has not cleared yet.
    """

    rule_key: str
    device_id: str
    telemetry_event_id: str
    reason: str
    observed_at: datetime
    raised_by_then: datetime | None = None


Outcome: TypeAlias = Firing | Clearing


class Evaluation(msgspec.Struct, frozen=True, gc=False):
    """What one message does: `outcomes`, to write in this order.

    A msgspec Struct, not a frozen dataclass: one is built per message of every batch, and
    the dataclass's construction cost about 1 µs a message (measured in a drain's profile)."""

    outcomes: tuple[Outcome, ...] = ()
    # Set when the message was judged at another time than its device time (its receipt,
    # the newest time judged), or ordered by its seq against its device time.
    clock_adjustment: ClockAdjustment | None = None
    # The time it was judged at, when `clock_adjustment` is set.
    judged_at: datetime | None = None
    # Rules for which it is a late sample the state cannot place: judged again from the
    # stored samples of its run (gateway.domain.rules.runs); empty when its clock was adjusted.
    unplaced: tuple[str, ...] = ()

    @property
    def firings(self) -> tuple[Firing, ...]:
        return tuple(o for o in self.outcomes if isinstance(o, Firing))

    @property
    def clearings(self) -> tuple[Clearing, ...]:
        return tuple(o for o in self.outcomes if isinstance(o, Clearing))


class _Verdict(enum.Enum):
    VIOLATING = enum.auto()
    CLEAR = enum.auto()  # back past the clear threshold: re-arms a firing rule
    BAND = enum.auto()  # neither: inside the hysteresis band
    UNKNOWN = enum.auto()  # absent, or a type the comparison cannot judge


class _Run:
    """One message's evaluation: the states it reads and replaces, and its outcomes so far."""

    __slots__ = (
        "device_id",
        "device_ts",
        "event_id",
        "observed_at",
        "outcomes",
        "sent_at",
        "seq",
        "states",
        "unplaced",
        "window",
    )

    def __init__(
        self,
        states: RuleStates,
        device_id: str,
        event_id: str,
        observed_at: datetime,
        seq: int | None,
        *,
        sent_at: datetime | None = None,
        window: timedelta | None = None,
    ) -> None:
        self.states = states
        self.device_id = device_id
        self.event_id = event_id
        self.observed_at = observed_at  # the time it is judged at
        self.sent_at = observed_at if sent_at is None else sent_at  # its device time
        # Its device time as the state keeps the newest's: None when judged at it.
        # (The same object when judged at its own time: most samples, spared the comparison.)
        sent = self.sent_at
        self.device_ts = None if sent is observed_at or sent == observed_at else sent
        self.seq = seq
        self.outcomes: list[Outcome] = []
        self.unplaced: list[str] = []
        # `reorder_window` when its own time is within the clock's bounds (a duration between
        # two such samples is evidence: `_held_between`), else None.
        self.window = window

    def get(self, rule: Rule) -> RuleState:
        return self.states.get((self.device_id, rule.key), IDLE)

    def put(self, rule: Rule, state: RuleState) -> None:
        self.states[(self.device_id, rule.key)] = state

    def fire(
        self,
        rule: Rule,
        reason: str,
        *,
        observed: MetricValue | None = None,
        superseded_by: str | None = None,
        cleared_by: str | None = None,
    ) -> None:
        self.outcomes.append(
            Firing(
                rule.key,
                rule.severity,
                self.device_id,
                self.event_id,
                reason,
                self.observed_at,
                superseded_by,
                cleared_by,
                trigger=self._trigger(rule, observed),
                rule_description=rule.description,
            )
        )

    def _trigger(self, rule: Rule, observed: MetricValue | None) -> dict[str, Any]:
        trigger = trigger_of(rule, self.observed_at, observed)
        if self.sent_at != self.observed_at:
            trigger["device_ts"] = self.sent_at.isoformat()  # judged at its receipt instead
        return trigger

    def clear(
        self,
        rule: Rule,
        reason: str,
        *,
        event_id: str | None = None,
        at: datetime | None = None,
        raised_by_then: datetime | None = None,
    ) -> None:
        self.outcomes.append(
            Clearing(
                rule.key,
                self.device_id,
                event_id or self.event_id,
                reason,
                at or self.observed_at,
                raised_by_then,
            )
        )

    def newest(self, state: RuleState) -> RuleState:
        """`state` with this sample as the newest judged, unless it is late: `last_ts`,
        `last_seq` and `last_device_ts` are always the times and seq of one sample."""
        if self.is_late(state):
            return state
        return replace(
            state, last_ts=self.observed_at, last_seq=self.seq, last_device_ts=self.device_ts
        )

    def is_late(self, state: RuleState) -> bool:
        """Older than the newest sample judged for this (device, rule)."""
        last = state.last_ts
        if last is None or self.observed_at > last:
            return False
        if self.observed_at < last:
            return True
        return self.seq is not None and state.last_seq is not None and self.seq < state.last_seq


def trigger_of(
    rule: Rule, sample_ts: datetime, observed: MetricValue | None = None
) -> dict[str, Any]:
    """Why ``rule`` fired on the sample of ``sample_ts`` (RFC 3339), as the alarm keeps it:
    an event rule's event, a threshold rule's comparison and the value that broke it."""
    at = sample_ts.isoformat()
    if isinstance(rule, ThresholdRule):
        return {
            "metric": rule.metric,
            "op": rule.op,
            "threshold": rule.value,
            "value": observed,
            "sample_ts": at,
        }
    if isinstance(rule, EventRule):
        return {"event": rule.event, "sample_ts": at}
    return {"sample_ts": at}


def silence_trigger(silent_since: datetime, beside: Sequence[str] = ()) -> dict[str, Any]:
    """Why an inactivity rule fired: the device has been silent since then (RFC 3339); and
    `beside`, the keys of the inactivity rules configured when it fired (`inactivity_rules`):
    none of them is this rule renamed, so each raises its own alarm for the silence even once
    a reload removed this one."""
    trigger: dict[str, Any] = {"silent_since": silent_since.isoformat()}
    if beside:
        trigger["inactivity_rules"] = sorted(beside)
    return trigger


def evaluate(
    rules: RuleSet,
    states: RuleStates,
    device_id: str,
    event_id: str,
    message: Telemetry,
    *,
    received_at: datetime | None = None,
    clock: DeviceClock = DeviceClock(),
    keys: Iterable[SlotKey] | None = None,
    heard_at: datetime | None = None,
) -> Evaluation:
    """Judge one telemetry message of `device_id` (whose telemetry event id is `event_id`).

    Reads and replaces the entries of `states` for the pairs `state_keys` names (`keys`: what
    it returned for this message, when the caller has it already); the caller writes them
    back in the transaction that writes the outcomes (or drops them on rollback).

    The ordering rule, for samples of one device committed out of order by several nodes:
    a late sample (older than the newest judged for that rule) is stored but never moves the
    state back. It still raises the alarm one node reading in device order would have raised,
    where nothing newer already stands for it: a late event becomes an alarm already cleared
    by its clear, or already superseded by the alarm raised since; a late violating sample of
    a rule that one sample fires raises its alarm, cleared if a newer sample cleared; one
    inside the current run of violations counts towards `for_samples`; a late clear clears
    the alarm that was active at its time (the firing one, if it is older and nothing has
    violated since). Otherwise it changes nothing: it never undoes what a newer sample
    decided.

    With `received_at` (the daemon always gives it), device time counts only within the bounds
    of `clock` (`judged_time`): outside them the message is judged at its receipt, and a rule
    state holding times from a clock ahead is brought back first. Without it, device time
    alone (the pure ordering rule above, for tests of it). Either way, where the message and
    the newest sample judged both have a seq, seq orders them first, and the newest's own time
    (`last_device_ts`) where it was judged at another (`seq_order`). `heard_at`: when the
    message was received if not at `received_at` (a replayed dead letter): its receipt for
    the bounds, so a reading received hours ago and replayed now is judged then, not now.
    """
    device_rules = rules._device(device_id)
    if not device_rules.rules:
        return Evaluation()
    sent = message.timestamp()
    at, adjustment = sent, None
    newest: datetime | None = None
    newest_seq: int | None = None
    newest_sent: datetime | None = None
    for key in state_keys(rules, device_id, message) if keys is None else keys:
        state = states.get(key)
        if state is None:
            continue
        if received_at is not None:
            repaired = _without_future(state, received_at, clock)
            if repaired is not None:
                states[key] = state = repaired
                adjustment = ClockAdjustment.STATE_AHEAD
        last = state.last_ts
        if last is not None and (
            newest is None or last > newest or (last == newest and _seq_above(state, newest_seq))
        ):
            newest, newest_seq, newest_sent = last, state.last_seq, state.last_device_ts
    # The sample's receipt: the batch's, or when a replayed dead letter was received (its
    # bounds are its own; a state ahead is still judged against the batch's clock, above).
    receipt = received_at if heard_at is None else heard_at
    if receipt is not None:
        at, judged = judged_time(sent, receipt, newest, clock)
        adjustment = judged or adjustment
    # Judged at its receipt (its own time past the bounds), its own time measures nothing.
    window = clock.reorder_window if at == sent else None
    seq = message.seq
    # seq_order changes nothing for a sample at or after the newest judged whose seq (if both
    # have one) is not below the newest's: most samples, spared the call.
    if newest is not None and (
        at < newest or (seq is not None and newest_seq is not None and seq < newest_seq)
    ):
        at, ordered = seq_order(
            at,
            seq,
            newest,
            newest_seq,
            sent=sent,
            newest_sent=newest_sent,
            received=receipt,
            clock=clock,
        )
        adjustment = adjustment or ordered
    run = _Run(states, device_id, event_id, at, seq, sent_at=sent, window=window)
    if message.events:
        _judge_events(device_rules, message.event_types(), run)
    if message.metrics:
        for threshold in device_rules.thresholds:
            if threshold.metric in message.metrics:
                _judge_sample(threshold, message.metrics[threshold.metric], run)
    return Evaluation(
        tuple(run.outcomes),
        adjustment,
        None if adjustment is None else at,
        () if adjustment is not None else tuple(run.unplaced),
    )


def _seq_above(state: RuleState, seq: int | None) -> bool:
    return state.last_seq is not None and (seq is None or state.last_seq > seq)


def _judge_events(device_rules: _DeviceRules, event_types: Sequence[str], run: _Run) -> None:
    occurrences = Counter(event_types)
    fired: set[str] = set()
    for event_type in event_types:
        for rule in device_rules.events.get(event_type, ()):
            # One alarm per rule, device and telemetry event (the dedup key): repeats within
            # a message collapse, even after a clear in between.
            if rule.key not in fired:
                fired.add(rule.key)
                _occurred(rule, _event_reason(event_type, occurrences[event_type]), run)
        for rule in device_rules.cleared.get(event_type, ()):
            _clear_event(rule, event_type, run)


def _occurred(rule: EventRule, reason: str, run: _Run) -> None:
    state = run.get(rule)
    at = run.observed_at
    if state.fired_ts is not None and (at < state.fired_ts or _before_alarm_by_seq(state, run)):
        # Late, and older than the alarm raised since: that one superseded it; a clear event
        # between the two cleared it first.
        between = state.clear_ts is not None and at < state.clear_ts <= state.fired_ts
        run.fire(
            rule,
            reason,
            superseded_by=state.fired_event_id,
            cleared_by=state.clear_event_id if between else None,
        )
        run.put(rule, run.newest(state))
        return
    run.fire(rule, reason)
    before_clear = _before_clear_by_seq(state, run)
    # An event rule keeps no violation: none noted by a threshold rule of this key before a
    # reload changed its kind may stand for this alarm should it be a threshold rule again
    # (`RuleState.redefined`).
    state = replace(
        run.newest(state), firing=True, fired_ts=at, fired_event_id=run.event_id, violating_ts=None
    )
    if (
        state.clear_ts is not None
        and state.clear_event_id is not None
        and (at < state.clear_ts or before_clear)
    ):
        # Late, and its own clear committed first: the event still happened.
        run.clear(
            rule,
            f"cleared by an event of {state.clear_ts.isoformat()} committed before it",
            event_id=state.clear_event_id,
            at=state.clear_ts,
        )
        state = replace(state, firing=False, released_ts=state.clear_ts)
    run.put(rule, state)


def _before_newest_by_seq(state: RuleState, run: _Run) -> bool:
    """The newest sample judged for the rule is of this sample's time too, and seq says it
    came after this one."""
    return (
        state.last_ts == run.observed_at
        and run.seq is not None
        and state.last_seq is not None
        and run.seq < state.last_seq
    )


def _before_alarm_by_seq(state: RuleState, run: _Run) -> bool:
    """An occurrence dated like the latest alarm's, which seq says came before it: the newest
    sample judged for the rule is of that time too, with a higher seq, and no clear of that
    time was judged, so that newest one is the occurrence that raised the alarm."""
    at = run.observed_at
    return state.fired_ts == at and state.clear_ts != at and _before_newest_by_seq(state, run)


def _before_clear_by_seq(state: RuleState, run: _Run) -> bool:
    """An occurrence dated like the newest clear, which seq says came before it: the newest
    sample judged for the rule is of that time too, with a higher seq, and no occurrence of
    that time was judged (it would be the alarm raised then): so that newest one is a clear
    (a clock of one-second resolution, pressed and released within the second)."""
    at = run.observed_at
    return (
        state.clear_ts == at
        and (state.fired_ts is None or state.fired_ts < at)
        and _before_newest_by_seq(state, run)
    )


def _clear_event(rule: EventRule, event_type: str, run: _Run) -> None:
    state = run.get(rule)
    at = run.observed_at
    reason = f"{event_type} clears {rule.event}"
    if state.fired_ts is not None and at < state.fired_ts:
        run.clear(rule, reason, raised_by_then=at)  # late: the alarm of its time
    elif state.firing:
        run.clear(rule, reason)
        state = replace(state, firing=False, released_ts=at)
    if state.clear_ts is None or at >= state.clear_ts:
        state = replace(state, clear_ts=at, clear_event_id=run.event_id)
    run.put(rule, run.newest(state))


def _judge_sample(rule: ThresholdRule, observed: MetricValue, run: _Run) -> None:
    verdict = _verdict(rule, observed)
    if verdict is _Verdict.UNKNOWN:
        return
    state = run.get(rule)
    late = run.is_late(state)
    before = state
    state = _noted(state, verdict, run)
    if late:
        if _unplaced(rule, verdict, state, run.observed_at):
            run.unplaced.append(rule.key)
        _judge_late_sample(rule, observed, verdict, state, run)
        return
    at = run.observed_at
    state = run.newest(state)
    if state.firing:
        if verdict is _Verdict.CLEAR:
            run.clear(rule, _clear_reason(rule, observed))
            state = replace(state, firing=False, released_ts=at)
        run.put(rule, state)
    elif verdict is _Verdict.VIOLATING:
        since = (
            at
            if state.pending_since is None
            else state.pending_since - _held_between(rule, before, run)
        )
        _count_violation(
            rule, observed, run, state, count=state.pending_count + 1, since=since, newest=at
        )
    else:
        run.put(rule, state.rearmed())


def _held_between(rule: ThresholdRule, state: RuleState, run: _Run) -> timedelta:
    """How much longer a pending hold has held at this newer sample than the times it and the
    newest were judged at say: its own time past the newest's own time where the newest was
    judged at a time after its own (`stepped_back` or `corrected`: the newest time already
    judged, its clock stepped back within the bounds), less the time the run moved on. A
    clock ahead within `max_future_skew_s`, stepped back by NTP, dates its next samples before
    the newest judged, and they are judged at that time, one after the other: the hold made
    no progress while the clock caught up, and fired up to `max_future_skew_s` late. Its own
    clock, within the bounds on both samples, measures the time between them. Zero where
    either sample's own time is past the bounds (a clock ahead, a reset to 1970, an upload
    judged at its receipt: within `reorder_window` of the time it was judged at, below it, is
    only a time the clock placed), or where the rule holds no time."""
    own, last = state.last_device_ts, state.last_ts
    window = run.window
    if (
        rule.for_seconds <= 0
        or window is None
        or own is None
        or last is None
        or not last - window <= own < last
        or run.sent_at <= own
    ):
        return _NO_TIME
    return max(_NO_TIME, (run.sent_at - own) - (run.observed_at - last))


_NO_TIME: Final = timedelta(0)


def _noted(state: RuleState, verdict: _Verdict, run: _Run) -> RuleState:
    """The newest violating and the newest clearing sample, whatever the commit order."""
    at = run.observed_at
    if verdict is _Verdict.VIOLATING and (state.violating_ts is None or at > state.violating_ts):
        return replace(state, violating_ts=at)
    if verdict is _Verdict.CLEAR and (state.clear_ts is None or at >= state.clear_ts):
        return replace(state, clear_ts=at, clear_event_id=run.event_id)
    return state


def _count_violation(
    rule: ThresholdRule,
    observed: MetricValue,
    run: _Run,
    state: RuleState,
    *,
    count: int,
    since: datetime,
    newest: datetime,
) -> None:
    held = newest - since
    if count >= rule.for_samples and held >= timedelta(seconds=rule.for_seconds):
        run.fire(rule, _threshold_reason(rule, observed, count, held), observed=observed)
        state = replace(state.rearmed(), firing=True, fired_ts=newest, fired_event_id=run.event_id)
    else:
        state = replace(state, pending_count=count, pending_since=since)
    run.put(rule, state)


def _unplaced(rule: ThresholdRule, verdict: _Verdict, state: RuleState, at: datetime) -> bool:
    """Whether a late sample of a rule that counts samples lies where the state cannot say
    what device order made of it: a violation outside the pending run and before the firing
    one (its run may have reached `for_samples`, or been cut short), a break inside the
    pending run (it splits it), a clear before the latest alarm (it may end a run that
    alarm was taken to stand for), a clear after the latest alarm and before its release
    with a violation since (in device order it cleared, and the violation began a new run).
    See gateway.domain.rules.runs."""
    if rule.for_samples <= 1 or rule.for_seconds > 0:
        return False
    if verdict is _Verdict.VIOLATING:
        in_pending = state.pending_since is not None and state.pending_since <= at
        in_firing = state.firing and state.fired_ts is not None and state.fired_ts <= at
        return not (in_pending or in_firing)
    if state.pending_since is not None and state.pending_since < at:
        return True
    if verdict is not _Verdict.CLEAR or state.fired_ts is None:
        return False
    # Before the latest alarm: it may end a run the alarm was taken to stand for. After it
    # and before its release (or while it fires), with a violation since: in device order
    # the alarm ended here, and that violation began a run of its own.
    released_later = state.released_ts is not None and at < state.released_ts
    violated_since = state.violating_ts is not None and state.violating_ts > at
    return at < state.fired_ts or ((state.firing or released_later) and violated_since)


def clears(rule: ThresholdRule, observed: MetricValue) -> bool:
    """Whether a sample of `observed` says clear for `rule` (neither violating nor in band):
    after one, in device order, the rule is neither firing nor pending."""
    return _verdict(rule, observed) is _Verdict.CLEAR


def _judge_late_sample(
    rule: ThresholdRule, observed: MetricValue, verdict: _Verdict, state: RuleState, run: _Run
) -> None:
    """A sample older than the newest judged: it acts only where device order says it would
    have and nothing newer says otherwise (see `evaluate`)."""
    at = run.observed_at
    if verdict is _Verdict.CLEAR:
        if state.fired_ts is not None and at < state.fired_ts:
            # Older than the alarm raised since: it clears the alarm of its time, if any.
            run.clear(rule, _clear_reason(rule, observed), raised_by_then=at)
        elif state.firing and (state.violating_ts is None or state.violating_ts < at):
            # It cleared the firing alarm in device order, and nothing has violated since.
            run.clear(rule, _clear_reason(rule, observed))
            state = replace(state, firing=False, released_ts=at)
        run.put(rule, state)
        return
    if verdict is not _Verdict.VIOLATING or state.firing:
        run.put(rule, state)
        return
    newest = state.last_ts or at
    if state.pending_since is not None and state.pending_since <= at:
        # Inside the current run of violations: in device order it was one of them.
        since = state.pending_since
        _count_violation(
            rule, observed, run, state, count=state.pending_count + 1, since=since, newest=newest
        )
        return
    if (
        rule.for_samples > 1
        or rule.for_seconds > 0
        or (
            state.fired_ts is not None
            and (at < state.fired_ts or state.released_ts is None or at < state.released_ts)
        )
    ):
        # Which run of violations it belonged to is no longer known; or an alarm raised
        # since stands for it; or the rule was firing at its time.
        run.put(rule, state)
        return
    run.fire(rule, _threshold_reason(rule, observed, 1, timedelta(0)), observed=observed)
    state = replace(state, firing=True, fired_ts=at, fired_event_id=run.event_id)
    if state.clear_ts is not None and state.clear_event_id is not None and at < state.clear_ts:
        run.clear(
            rule,
            f"cleared by a sample of {state.clear_ts.isoformat()} committed before it",
            event_id=state.clear_event_id,
            at=state.clear_ts,
        )
        state = replace(state, firing=False, released_ts=state.clear_ts)
    run.put(rule, state)


def _verdict(rule: ThresholdRule, observed: MetricValue) -> _Verdict:
    op = rule.op
    if op in _EQUALITY:
        holds = _same(observed, rule.value) == (op == "==")
        return _Verdict.VIOLATING if holds else _Verdict.CLEAR
    threshold = rule.value
    clear_threshold = threshold if rule.clear_value is None else rule.clear_value
    if type(observed) is str:
        observed = _decimal(observed)
    if not (_is_number(observed) and _is_number(threshold) and _is_number(clear_threshold)):
        return _Verdict.UNKNOWN
    if _COMPARE[op](observed, threshold):
        return _Verdict.VIOLATING
    back = observed < clear_threshold if op in _ABOVE else observed > clear_threshold
    return _Verdict.CLEAR if back else _Verdict.BAND


def _decimal(text: str) -> float | str:
    """A sample written as a decimal number in a string (``"17.12"``: the Dragino LHT65's
    ChirpStack codec writes its readings with ``toFixed``), as that number where a threshold
    orders it (``>``, ``<``...): as text it was judged as no number, and the rule never fired
    nor said why. Any other string stays as read (no NaN, infinity, hex or ``_``, which
    ``float()`` would take); ``==`` and ``!=`` keep kinds apart (``"1"`` is not ``1``)."""
    if _DECIMAL_RE.fullmatch(text) is None:
        return text
    number = float(text)
    return number if math.isfinite(number) else text


# A decimal number: an optional sign, digits with a fraction, an exponent, spaces around.
_DECIMAL_RE: Final = re.compile(r"\s*[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?\s*")
_EQUALITY: Final = frozenset(("==", "!="))
_ABOVE: Final = frozenset((">", ">="))  # ops that violate above the threshold
# Each op as its comparison (a lookup: `_verdict` runs for every sample of every batch).
_COMPARE: Final[Mapping[Op, Callable[[Any, Any], bool]]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


def _same(left: MetricValue, right: MetricValue) -> bool:
    """Equality that keeps kinds apart: `true` is not `1`, `"1"` is not `1`; `1 == 1.0`."""
    if isinstance(left, bool) or isinstance(right, bool):
        return isinstance(left, bool) and isinstance(right, bool) and left == right
    if isinstance(left, str) or isinstance(right, str):
        return isinstance(left, str) and isinstance(right, str) and left == right
    return left == right


def inactivity_firing(
    rule: InactivityRule, device_id: str, last_seen: datetime, now: datetime
) -> bool:
    """Whether `rule` applies to the device and it has been silent long enough."""
    return rule.selector.matches(device_id) and now - last_seen >= timedelta(
        seconds=rule.silent_seconds
    )


# --- holds on the clock ------------------------------------------------------------------
#
# A threshold rule with `for_seconds` fires when a sample shows the violation has held long
# enough; a device that reports by exception sends no such sample, so the hold timer
# (gateway.alarms.holds) also judges pending rows on the database clock. The hold is measured
# on the row's own timeline: device time up to the newest sample judged (`last_ts`, the same
# time `_count_violation` compares), then database time since that sample's batch wrote the
# row (`written_at`, the row's `updated_at`). Neither clock alone will do: `pending_since` is a
# device time, possibly hours behind the database's (a clock behind, a store-and-forward
# upload) — compared with the database's `now` it would fire at once — and the database's
# time since the first violation knows nothing of the samples between.


def hold_due_at(rule: ThresholdRule, state: RuleState, written_at: datetime) -> datetime | None:
    """The database time at which the pending violation of `state` has held `for_seconds`
    with no further sample, or None if the timer has nothing to judge: no hold, not pending,
    firing, or fewer than `for_samples` samples (those still have to arrive).

    `written_at` is when the row was last written; a write later than the newest sample's
    batch (a late sample counted) only makes the hold end later, never earlier."""
    since, last = state.pending_since, state.last_ts
    if (
        rule.for_seconds <= 0
        or state.firing
        or since is None
        or last is None
        or state.pending_count < rule.for_samples
    ):
        return None
    return written_at + (since + timedelta(seconds=rule.for_seconds) - last)


def hold_event_id(rule_key: str, device_id: str, pending_since: datetime) -> str:
    """The stand-in telemetry event id of an alarm the hold timer raises: derived from the
    stored run of violations, so every node computes the same dedup key for the same hold."""
    source = f"hold\n{rule_key}\n{device_id}\n{pending_since.isoformat()}".encode()
    return hashlib.sha256(source).hexdigest()


def fire_held(
    rule: ThresholdRule,
    device_id: str,
    state: RuleState,
    *,
    written_at: datetime,
    now: datetime,
) -> tuple[Firing, RuleState] | None:
    """The firing of a pending violation whose hold has passed by `now` (database time), and
    the state to write back; None if it is not due (see `hold_due_at`).

    The alarm is dated, in the row's timeline, when the hold completed (`pending_since +
    for_seconds`), which is after the newest sample judged. The next clearing sample clears
    it as it clears any firing alarm (even one dated before the hold completed: the device
    cleared in time, but said so too late); a late sample (older than the newest judged)
    leaves it. The value that violated is not kept in the row, so the trigger names the run's
    start and its length instead."""
    due = hold_due_at(rule, state, written_at)
    if due is None or due > now or not rule.selector.matches(device_id):
        return None
    since = state.pending_since
    assert since is not None  # hold_due_at checked it
    held = timedelta(seconds=rule.for_seconds)
    fired_ts = since + held
    event_id = hold_event_id(rule.key, device_id, since)
    reason = f"{rule.metric} {rule.op} {_show(rule.value)}"
    if state.pending_count > 1:
        reason += f" for {state.pending_count} samples"
    reason += f" held {held.total_seconds():g}s with no sample since (hold timer)"
    trigger = trigger_of(rule, fired_ts)
    trigger["pending_since"] = since.isoformat()
    trigger["pending_samples"] = state.pending_count
    firing = Firing(
        rule.key,
        rule.severity,
        device_id,
        event_id,
        reason,
        fired_ts,
        trigger=trigger,
        rule_description=rule.description,
    )
    fired = replace(state.rearmed(), firing=True, fired_ts=fired_ts, fired_event_id=event_id)
    return firing, fired


# --- a row whose rule a reload changed ----------------------------------------------------
#
# A row written under another definition of its rule keeps its facts: a batch that next reads
# it judges its sample under the definition in force from there. A device that reports by
# exception sends no such sample, so the hold timer judges the firing and normal rows of a
# definition no live node runs any more from the device's newest stored sample of the metric
# (gateway.alarms.engine.AlarmEngine.rejudge_stale_rows; pending holds: rejudge_stale_holds).


def rejudged_event_id(
    rule_key: str, device_id: str, sample_event_id: str, rule_version: str, row_version: int
) -> str:
    """The stand-in telemetry event id of an alarm a reload's judgement raises: derived from
    the stored sample, the definition in force and the version of the row judged, so every
    node computes the same dedup key for the same judgement, and a definition changed back
    and forth over the same sample raises again (the sample's own alarm may have cleared)."""
    source = (
        f"rejudged\n{rule_key}\n{device_id}\n{sample_event_id}\n{rule_version}\n{row_version}"
    ).encode()
    return hashlib.sha256(source).hexdigest()


@dataclass(frozen=True, slots=True)
class Rejudged:
    """What judging a row again under the definition in force does: the state to write, and
    the alarm to raise or to clear (at most one)."""

    state: RuleState
    firing: Firing | None = None
    clearing: Clearing | None = None


def judged_again(
    rule: ThresholdRule,
    device_id: str,
    state: RuleState,
    newest: tuple[MetricValue, str] | None,
    *,
    run: tuple[int, datetime | None] = (1, None),
    event_id: str,
    added: bool = False,
) -> Rejudged:
    """A firing or normal row of `rule` written under another definition (a reload), judged
    under `rule` from the device's newest stored sample of its metric (`newest`: its value
    and event id; None when none is stored, or the rule no longer selects the device) and the
    run of violations it ends (`run`: count and first sample's time, `current_run`).

    The row's own timeline places it: the judgement is at its newest time judged (`last_ts`).
    - Firing, and the sample is back past the clear threshold: the alarm clears (by that
      sample; the reason says the rule changed). Still violating, or in the hysteresis band:
      it stays firing, as a sample there would leave it.
    - Not firing, and the sample violates: the run fires if it has its `for_samples` and the
      rule holds no time (`event_id`: `rejudged_event_id`); with `for_seconds`, it is pending
      from the judgement (`pending_since` = `last_ts`, and the row written now: the hold runs
      `for_seconds` of database time from this write, as `hold_due_at` reads it); else it is
      pending with its count.
    - Otherwise, and with no sample: its facts kept, nothing pending.
    ``added``: the row was created for a rule a node has just taken up, placed at that sample
    and written under no definition (storage.rule_state.seed_added): an alarm raised says the
    rule was added, not changed."""
    state = state.redefined(rule)
    at = state.last_ts
    if newest is None or at is None:
        return Rejudged(state)
    value, sample_event_id = newest
    verdict = _verdict(rule, value)
    if state.firing:
        if verdict is not _Verdict.CLEAR:
            return Rejudged(state)
        newer = state.clear_ts is None or at >= state.clear_ts
        cleared = replace(
            state,
            firing=False,
            released_ts=at,
            clear_ts=at if newer else state.clear_ts,
            clear_event_id=sample_event_id if newer else state.clear_event_id,
        )
        reason = f"{_clear_reason(rule, value)} ({_REJUDGED})"
        return Rejudged(
            cleared, clearing=Clearing(rule.key, device_id, sample_event_id, reason, at)
        )
    if verdict is not _Verdict.VIOLATING:
        return Rejudged(state.rearmed())
    why = _ADDED if added else _REJUDGED
    return _violating_again(rule, device_id, state, value, at, run=run, event_id=event_id, why=why)


_REJUDGED: Final = "the rule changed: judged again from the newest stored sample"
_ADDED: Final = "the rule was added: judged from the newest stored sample"


def _violating_again(
    rule: ThresholdRule,
    device_id: str,
    state: RuleState,
    value: MetricValue,
    at: datetime,
    *,
    run: tuple[int, datetime | None],
    event_id: str,
    why: str,
) -> Rejudged:
    """`judged_again` of a row not firing whose newest sample violates the rule in force."""
    if state.violating_ts is None or at > state.violating_ts:
        state = replace(state, violating_ts=at)
    count, since = run
    if rule.for_seconds > 0:
        return Rejudged(replace(state, pending_count=max(count, 1), pending_since=at))
    if count < rule.for_samples:
        return Rejudged(replace(state, pending_count=count, pending_since=since or at))
    firing = Firing(
        rule.key,
        rule.severity,
        device_id,
        event_id,
        f"{_threshold_reason(rule, value, count, timedelta(0))} ({why})",
        at,
        trigger=trigger_of(rule, at, value),
        rule_description=rule.description,
    )
    fired = replace(state.rearmed(), firing=True, fired_ts=at, fired_event_id=event_id)
    return Rejudged(fired, firing=firing)


def violates(rule: ThresholdRule, observed: MetricValue) -> bool:
    """Whether a sample of `observed` violates `rule`."""
    return _verdict(rule, observed) is _Verdict.VIOLATING


def _event_reason(event_type: str, occurrences: int) -> str:
    if occurrences == 1:
        return f"event {event_type}"
    return f"event {event_type} ({occurrences} occurrences in the message)"


def _threshold_reason(
    rule: ThresholdRule, observed: MetricValue, samples: int, held: timedelta
) -> str:
    reason = f"{rule.metric} {_show(observed)} {rule.op} {_show(rule.value)}"
    if samples > 1:
        reason += f" for {samples} samples"
    if rule.for_seconds > 0:
        reason += f" over {held.total_seconds():g}s"
    return reason


def _clear_reason(rule: ThresholdRule, observed: MetricValue) -> str:
    if rule.op in ("==", "!="):
        return f"{rule.metric} {_show(observed)} {_NEGATED[rule.op]} {_show(rule.value)}"
    back = "<" if rule.op in (">", ">=") else ">"
    return f"{rule.metric} {_show(observed)} {back} {_show(rule.clear_threshold)} (clear value)"


def _show(value: MetricValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    return str(value)
