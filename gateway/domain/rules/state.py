"""The state of one (device, rule), `RuleState` (a row of the `rule_state` table), the
device clocks that order samples, and which states a message touches (`state_keys`)."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, TypeAlias

import msgspec

from gateway.domain.rules.model import (
    EventRule,
    Rule,
    RuleSet,
    ThresholdRule,
)
from protocol import Telemetry

__all__ = [
    "IDLE",
    "ClockAdjustment",
    "DeviceClock",
    "RuleState",
    "RuleStates",
    "SlotKey",
    "judged_time",
    "replace",
    "rule_version",
    "seq_order",
    "state_keys",
]


SlotKey: TypeAlias = tuple[str, str]  # (device_id, rule_key)


class RuleState(msgspec.Struct, frozen=True, gc=False):
    """The evaluation state of one (device, rule): one row of the `rule_state` table.

    Every time here is a device time (a sample's own timestamp), never a node's clock, so that
    every node judges the same samples alike. `last_ts`/`last_seq` order the samples: one older
    than the newest already judged is *late* (another node committed a newer one first), and a
    late sample never moves the state back (see `evaluate`). `last_device_ts` is the newest
    sample's own device time where it was judged at another (`last_ts`: its receipt, or the
    newest time judged before it), else None.
    """

    firing: bool = False
    pending_count: int = 0  # consecutive violating samples of a threshold not yet fired
    pending_since: datetime | None = None  # the first of them
    last_ts: datetime | None = None  # the newest sample judged
    last_seq: int | None = None
    fired_ts: datetime | None = None  # the sample that raised the latest alarm
    fired_event_id: str | None = None
    released_ts: datetime | None = None  # the sample that cleared the latest alarm
    clear_ts: datetime | None = None  # the newest sample or event that says "clear"
    clear_event_id: str | None = None
    violating_ts: datetime | None = None  # the newest violating sample (thresholds)
    last_device_ts: datetime | None = None  # the newest sample's own time, if not last_ts

    def rearmed(self) -> RuleState:
        """The same facts under a changed rule definition: pending samples no longer count."""
        return replace(self, pending_count=0, pending_since=None)

    def redefined(self, rule: Rule) -> RuleState:
        """The facts of a row written under another definition, as `rule` takes them: all
        but its pending samples (`rearmed`). And a rule takes no facts of another kind (a
        reload changed the rule's kind under the same key): a threshold rule is firing only
        where a violation fired it: a row firing with no violating sample since its latest
        alarm was an event rule's (an event rule's row stays firing after an occurrence no
        clear event ends, and keeps no violation, `violating_ts`), and the threshold rule
        starts from normal (taken as its own violation going on, it raised nothing for the
        device's violations until one of its samples cleared). An event rule takes nothing
        but the ordering (`last_ts`, `last_seq`, `last_device_ts`) from a threshold's row."""
        state = self.rearmed()
        if state.firing and isinstance(rule, ThresholdRule) and state.violating_ts is None:
            return replace(state, firing=False)
        if isinstance(rule, EventRule) and state.violating_ts is not None:
            # Only a threshold rule notes a violation (an occurrence forgets them): the row
            # is a threshold's, and its alarm and clears are no occurrence of this event.
            # Clears pair strictly by type: an SOS_CLEAR used to clear the threshold's alarm,
            # and an occurrence dated before it was created superseded by it.
            return replace(
                state,
                firing=False,
                fired_ts=None,
                fired_event_id=None,
                released_ts=None,
                clear_ts=None,
                clear_event_id=None,
                violating_ts=None,
            )
        return state


# A msgspec Struct, not a dataclass: evaluation replaces a state several times per sample, and
# msgspec's replace is about ten times cheaper than dataclasses.replace.
replace = msgspec.structs.replace


IDLE: Final = RuleState()

# The states of the (device, rule) pairs a batch touches, read under lock at the start of the
# batch's transaction; `evaluate` replaces entries as it goes. A missing key is `IDLE`.
RuleStates: TypeAlias = MutableMapping[SlotKey, RuleState]


# --- device clocks --------------------------------------------------------------------------


class ClockAdjustment(enum.StrEnum):
    """Why a sample was judged at another time than its device time, or ordered by its
    `seq` against what its device time says."""

    AHEAD = "ahead"  # dated further ahead of its receipt than max_future_skew
    BEHIND = "behind"  # further back than reorder_window from the newest already judged
    STATE_AHEAD = "state_ahead"  # the rule state held device times from a clock ahead
    # Its seq follows the newest judged, its time is before it (an NTP step back): newer,
    # judged at the newest time already judged.
    STEPPED_BACK = "stepped_back"
    # Its seq is below the newest judged, its time after it (a reboot): a new seq epoch,
    # judged at its device time.
    SEQ_RESET = "seq_reset"
    # No seq to weigh; its time is before the newest judged, but after that one's own time,
    # or that one's own time was ahead of it (a clock corrected while its samples waited):
    # newer, judged at the newest time already judged.
    CORRECTED = "corrected"


@dataclass(frozen=True, slots=True)
class DeviceClock:
    """The bounds within which a device's own time orders its samples (docs/rules-and-alarms.md,
    "Device clocks"). Device time is evidence, not truth: a sample dated more than
    `max_future_skew` ahead of its receipt is judged at its receipt; one dated more than
    `reorder_window` before the newest sample already judged for its rules is a clock reset or
    a store-and-forward upload, not a reordering between nodes, and is judged at its receipt
    too (in arrival order): it neither moves a rule's state back to its old time nor holds the
    state at a bogus one."""

    max_future_skew: timedelta = timedelta(seconds=300)
    reorder_window: timedelta = timedelta(seconds=300)


def judged_time(
    sent: datetime, received: datetime, newest: datetime | None, clock: DeviceClock
) -> tuple[datetime, ClockAdjustment | None]:
    """The time a sample is judged at: its device time `sent` within the bounds of `clock`,
    else its receipt `received` (and why). `newest` is the newest time already judged for the
    rules it touches."""
    if sent > received + clock.max_future_skew:
        return received, ClockAdjustment.AHEAD
    if newest is not None and sent < newest - clock.reorder_window:
        return received, ClockAdjustment.BEHIND
    return sent, None


def seq_order(
    at: datetime,
    seq: int | None,
    newest: datetime | None,
    newest_seq: int | None,
    *,
    sent: datetime | None = None,
    newest_sent: datetime | None = None,
    received: datetime | None = None,
    clock: DeviceClock | None = None,
) -> tuple[datetime, ClockAdjustment | None]:
    """The time a sample judged at `at` (within the clock's bounds) is judged at once it is
    weighed against the newest sample already judged (`newest`, `newest_seq`, and that one's
    own device time `newest_sent`: None when it was judged at it).

    Where both have a seq, seq orders the device's samples inside an epoch, and a new epoch
    (seq dropping while time moves forward: a reboot) is newer than the last, in arrival
    order. A seq above the newest judged with a time before it is a clock stepped back (NTP),
    not a reordering: the sample is newer, judged at `newest` so that no state moves back. A
    seq below with a time after is a new epoch, judged at its time, unless the sample was
    judged at its receipt (`at` is not its own time `sent`: a clock past the bounds) and its
    own time is within `reorder_window` at or before the newest's own time, received within
    `reorder_window` of the newest time judged: its seq and its own time both say older, and
    only its receipt is later (a reordering between nodes of a clock stuck at 1970, or hours
    ahead). It is late, judged just before the newest (a microsecond per seq between them,
    at most a second). Where seq and time agree, time orders (a reordering between nodes
    stays late).

    Where either has no seq, time orders, and the newest's own time where it was judged at
    another: a sample judged at its own time `sent`, before the newest time judged, is newer
    (judged at it) if it is dated after the newest's own time, or that own time was ahead of
    the time it was judged at (its place in device time is unknown: arrival orders), else
    late."""
    if newest is None:
        return at, None
    if seq is None or newest_seq is None:
        # Judged at its own time, before the newest judged but after that one's own time (or
        # that one was ahead: its own time places it nowhere).
        if (
            at < newest
            and newest_sent is not None
            and sent == at
            and (newest_sent > newest or sent > newest_sent)
        ):
            return newest, ClockAdjustment.CORRECTED
        return at, None
    if seq > newest_seq and at < newest:
        return newest, ClockAdjustment.STEPPED_BACK
    if seq < newest_seq and at > newest:
        late = _late_past_bounds(
            at,
            seq,
            newest,
            newest_seq,
            sent=sent,
            newest_sent=newest_sent,
            received=received,
            clock=clock,
        )
        return (at, ClockAdjustment.SEQ_RESET) if late is None else (late, None)
    return at, None


def _late_past_bounds(
    at: datetime,
    seq: int,
    newest: datetime,
    newest_seq: int,
    *,
    sent: datetime | None,
    newest_sent: datetime | None,
    received: datetime | None,
    clock: DeviceClock | None,
) -> datetime | None:
    """The time a sample with a seq below the newest's, judged at its receipt `at` after the
    newest time judged, is judged at if it is late (see `seq_order`); None if it is a new
    epoch."""
    if clock is None or received is None or sent is None or sent == at:
        return None
    window = clock.reorder_window
    own = newest if newest_sent is None else newest_sent
    if received > newest + window or not own - window <= sent <= own:
        return None
    return newest - timedelta(microseconds=min(newest_seq - seq, _MOST_BEHIND_US))


# A late sample of a clock past the bounds, with seq, is judged this many microseconds at
# most before the newest sample judged (one a seq between them).
_MOST_BEHIND_US: Final = 1_000_000


_STATE_TIMES: Final = (
    "pending_since",
    "last_ts",
    "fired_ts",
    "released_ts",
    "clear_ts",
    "violating_ts",
)


def _without_future(state: RuleState, received: datetime, clock: DeviceClock) -> RuleState | None:
    """`state` with every time further ahead of `received` than the skew allows brought back
    to `received` (written from a clock ahead before this model, such a time would hold the
    rule until real time passed it); None when it has none."""
    bound = received + clock.max_future_skew
    # Every sample of a batch comes here once per rule it touches, and a state ahead is rare:
    # the plain comparisons first (a third of the cost of the general form below).
    if (
        (state.last_ts is None or state.last_ts <= bound)
        and (state.clear_ts is None or state.clear_ts <= bound)
        and (state.violating_ts is None or state.violating_ts <= bound)
        and (state.pending_since is None or state.pending_since <= bound)
        and (state.fired_ts is None or state.fired_ts <= bound)
        and (state.released_ts is None or state.released_ts <= bound)
    ):
        return None
    changes = {
        name: received
        for name in _STATE_TIMES
        if (value := getattr(state, name)) is not None and value > bound
    }
    return replace(state, **changes) if changes else None


def rule_version(rule: Rule) -> str:
    """A fingerprint of what a rule's state depends on (not its severity, devices or text).

    A state row written under another version keeps its facts (firing, the times) and drops
    its pending count: samples counted against `> 80` prove nothing about `> 90`. (The hold
    timer judges the rows of a threshold rule again from the stored samples themselves, once
    no live node runs their definition: a pending hold, `AlarmEngine.rejudge_stale_holds`; a
    firing or normal row, `AlarmEngine.rejudge_stale_rows` and `judged_again`.)
    """
    if isinstance(rule, ThresholdRule):
        parts: list[object] = [
            rule.kind,
            rule.metric,
            rule.op,
            rule.value,
            rule.clear_value,
            rule.for_samples,
            rule.for_seconds,
        ]
    elif isinstance(rule, EventRule):
        parts = [rule.kind, rule.event]
    else:
        parts = [rule.kind]
    return hashlib.sha256(msgspec.json.encode(parts)).hexdigest()[:16]


def state_keys(rules: RuleSet, device_id: str, message: Telemetry) -> set[SlotKey]:
    """The (device, rule) pairs whose state `evaluate` reads or writes for this message."""
    device_rules = rules._device(device_id)
    keys: set[SlotKey] = set()
    if not device_rules.rules:
        return keys
    if message.events:
        for event_type in message.event_types():
            for rule in device_rules.events.get(event_type, ()):
                keys.add((device_id, rule.key))
            for rule in device_rules.cleared.get(event_type, ()):
                keys.add((device_id, rule.key))
    if message.metrics:
        for threshold in device_rules.thresholds:
            if threshold.metric in message.metrics:
                keys.add((device_id, threshold.key))
    return keys
