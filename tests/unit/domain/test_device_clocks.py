"""Device time is evidence, not truth: the bounds within which it orders a device's samples
(issue: a clock set ahead hid a CRITICAL SOS; a clock reset to 1970 held a rule's state)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.domain.rules import (
    IDLE,
    ClockAdjustment,
    DeviceClock,
    Evaluation,
    RuleConfig,
    RuleSet,
    RuleState,
    RuleStates,
    compile_rules,
    evaluate,
    judged_time,
    state_keys,
)
from protocol import Telemetry

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
CLOCK = DeviceClock(max_future_skew=timedelta(seconds=300), reorder_window=timedelta(seconds=300))
RULES = compile_rules(
    [
        msgspec.convert(t, RuleConfig)
        for t in (
            {"key": "sos", "kind": "event", "event": "SOS", "severity": "CRITICAL"},
            {"key": "hot", "kind": "threshold", "metric": "temp", "op": ">", "value": 50,
             "clear_value": 40, "severity": "MAJOR"},
        )
    ]
)  # fmt: skip


def at(dt: datetime, **content: Any) -> Telemetry:
    return Telemetry(ts=dt, **content)


def sos(dt: datetime) -> Telemetry:
    return at(dt, events=[{"type": "SOS"}])


def temp(dt: datetime, value: float) -> Telemetry:
    return at(dt, metrics={"temp": value})


class Device:
    """One device's messages judged in arrival order, each at its own receipt, against the
    states as the database keeps them between batches."""

    def __init__(self, rules: RuleSet = RULES) -> None:
        self.rules = rules
        self.states: RuleStates = {}
        self.count = 0

    def send(self, message: Telemetry, received: datetime) -> Evaluation:
        self.count += 1
        keys = state_keys(self.rules, "dev-1", message)
        batch = {key: self.states[key] for key in keys if key in self.states}
        evaluation = evaluate(
            self.rules, batch, "dev-1", f"ev-{self.count}", message,
            received_at=received, clock=CLOCK,
        )  # fmt: skip
        self.states.update(batch)
        return evaluation

    def state(self, rule_key: str) -> RuleState:
        return self.states.get(("dev-1", rule_key), IDLE)


@pytest.mark.parametrize(
    ("sent", "newest", "judged", "why"),
    [
        (NOW, None, NOW, None),
        (NOW + timedelta(seconds=300), None, NOW + timedelta(seconds=300), None),
        (NOW + timedelta(seconds=301), None, NOW, ClockAdjustment.AHEAD),
        (NOW + timedelta(hours=8), NOW, NOW, ClockAdjustment.AHEAD),
        # A reordering between nodes, inside the window: device time decides.
        (NOW - timedelta(seconds=300), NOW, NOW - timedelta(seconds=300), None),
        # A reset or an upload: judged in arrival order.
        (NOW - timedelta(seconds=301), NOW, NOW, ClockAdjustment.BEHIND),
        (datetime(1970, 1, 1, tzinfo=UTC), NOW, NOW, ClockAdjustment.BEHIND),
        # Nothing judged yet: any past time is the device's.
        (datetime(1970, 1, 1, tzinfo=UTC), None, datetime(1970, 1, 1, tzinfo=UTC), None),
    ],
)
def test_judged_time(
    sent: datetime, newest: datetime | None, judged: datetime, why: ClockAdjustment | None
) -> None:
    assert judged_time(sent, NOW, newest, CLOCK) == (judged, why)


def test_a_clock_set_ahead_no_longer_hides_the_next_sos() -> None:
    device = Device()
    ahead = device.send(sos(NOW + timedelta(hours=8)), received=NOW)
    assert ahead.clock_adjustment is ClockAdjustment.AHEAD
    (first,) = ahead.firings
    assert first.observed_at == NOW
    assert first.trigger is not None
    assert first.trigger["device_ts"] == (NOW + timedelta(hours=8)).isoformat()
    # The real SOS a minute later: an alarm of its own, not "late" behind the bogus time.
    later = NOW + timedelta(minutes=1)
    real = device.send(sos(later), received=later)
    assert real.clock_adjustment is None
    (second,) = real.firings
    assert second.superseded_by_event is None
    assert second.observed_at == later


def test_a_clock_reset_to_1970_is_judged_in_arrival_order() -> None:
    device = Device()
    device.send(temp(NOW, 45), received=NOW)
    epoch = datetime(1970, 1, 1, 0, 0, 5, tzinfo=UTC)
    after = NOW + timedelta(seconds=30)
    hot = device.send(temp(epoch, 60), received=after)
    assert hot.clock_adjustment is ClockAdjustment.BEHIND
    assert [f.rule_key for f in hot.firings] == ["hot"]
    assert device.state("hot").last_ts == after
    # The next reset-clock samples go on in arrival order: the rule clears and fires again.
    cool = device.send(
        temp(epoch + timedelta(seconds=10), 30), received=after + timedelta(seconds=10)
    )
    assert [c.rule_key for c in cool.clearings] == ["hot"]
    again = device.send(
        temp(epoch + timedelta(seconds=20), 70), received=after + timedelta(seconds=20)
    )
    assert [f.rule_key for f in again.firings] == ["hot"]
    # And its SOS is raised, not judged late behind the state's real times.
    sos_evaluation = device.send(
        sos(epoch + timedelta(seconds=25)), received=after + timedelta(seconds=25)
    )
    (firing,) = sos_evaluation.firings
    assert firing.superseded_by_event is None


def test_a_threshold_is_never_held_by_a_state_written_from_a_clock_ahead() -> None:
    # A state as an earlier release wrote it from a sample dated 8 hours ahead.
    bogus = NOW + timedelta(hours=8)
    device = Device()
    device.states[("dev-1", "hot")] = RuleState(
        firing=True, last_ts=bogus, fired_ts=bogus, fired_event_id="old", violating_ts=bogus
    )
    cleared = device.send(temp(NOW, 30), received=NOW)
    assert cleared.clock_adjustment is ClockAdjustment.STATE_AHEAD
    assert [c.rule_key for c in cleared.clearings] == ["hot"]
    assert device.state("hot").last_ts == NOW
    fired = device.send(temp(NOW + timedelta(seconds=1), 90), received=NOW + timedelta(seconds=1))
    assert [f.rule_key for f in fired.firings] == ["hot"]


@pytest.mark.parametrize(
    "name",
    [name for name, kind in RuleState.__annotations__.items() if "datetime" in str(kind)],
)
def test_any_one_time_of_a_state_ahead_is_brought_back_to_the_receipt(name: str) -> None:
    # Each time a state holds, alone ahead of the skew, is repaired (and the sample says so);
    # one just within the skew is left alone.
    bogus, within = NOW + timedelta(hours=8), NOW + CLOCK.max_future_skew
    pairs = {"fired_ts": "fired_event_id", "clear_ts": "clear_event_id"}
    for when, repaired in ((bogus, True), (within, False)):
        device = Device()
        extra: dict[str, Any] = {pairs[name]: "old"} if name in pairs else {}
        device.states[("dev-1", "hot")] = RuleState(**{name: when}, **extra)
        judged = device.send(temp(NOW - timedelta(seconds=1), 45), received=NOW)
        if repaired:
            assert judged.clock_adjustment is ClockAdjustment.STATE_AHEAD, name
            assert getattr(device.state("hot"), name) != bogus, name
        else:
            assert judged.clock_adjustment is not ClockAdjustment.STATE_AHEAD, name


def test_inside_the_bounds_the_ordering_rule_is_unchanged() -> None:
    """Two nodes committing one device's samples out of order, seconds apart: a late event
    older than the alarm raised since is still created superseded by it."""
    device = Device()
    device.send(sos(NOW + timedelta(seconds=20)), received=NOW + timedelta(seconds=21))
    late = device.send(sos(NOW + timedelta(seconds=10)), received=NOW + timedelta(seconds=22))
    assert late.clock_adjustment is None
    (firing,) = late.firings
    assert firing.superseded_by_event == "ev-1"


# --- seq epochs ---------------------------------------------------------------------------
#
# Where a device sends `seq`, it orders the device's samples before its clock does: a seq
# that goes on counting up is newer whatever the clock says (an NTP step back), and a seq that
# drops while the clock moves forward starts a new epoch (a reboot), newer too. Where seq and
# clock agree, or either is missing, the ordering rule is unchanged.


def numbered(dt: datetime, seq: int | None, **content: Any) -> Telemetry:
    return Telemetry(ts=dt, seq=seq, **content)


def test_a_clock_stepped_back_while_seq_counts_up_judges_newer_samples_as_newer() -> None:
    """NTP steps the clock back 2 minutes (inside the reorder window): the next samples are
    dated before the newest judged, but their seq says they came after it."""
    device = Device()
    device.send(numbered(NOW, 100, metrics={"temp": 45}), received=NOW)
    stepped = NOW - timedelta(minutes=2) + timedelta(seconds=1)
    hot = device.send(
        numbered(stepped, 101, metrics={"temp": 60}), received=NOW + timedelta(seconds=1)
    )
    assert hot.clock_adjustment is ClockAdjustment.STEPPED_BACK
    (firing,) = hot.firings
    # Judged at the newest time already judged: the state never moves back.
    assert firing.observed_at == NOW
    assert firing.trigger is not None
    assert firing.trigger["device_ts"] == stepped.isoformat()
    assert hot.judged_at == NOW
    assert device.state("hot").last_ts == NOW
    assert device.state("hot").last_seq == 101
    # The next one, still dated before NOW, clears: it is newer by seq.
    cool = device.send(
        numbered(stepped + timedelta(seconds=1), 102, metrics={"temp": 30}),
        received=NOW + timedelta(seconds=2),
    )
    assert [c.rule_key for c in cool.clearings] == ["hot"]
    assert device.state("hot").last_seq == 102
    # And its SOS raises an alarm of its own, not one superseded by an older one.
    device.send(numbered(NOW, 103, events=[{"type": "SOS"}]), received=NOW + timedelta(seconds=3))
    again = device.send(
        numbered(stepped + timedelta(seconds=3), 104, events=[{"type": "SOS"}]),
        received=NOW + timedelta(seconds=4),
    )
    (sos_firing,) = again.firings
    assert sos_firing.superseded_by_event is None
    assert again.clock_adjustment is ClockAdjustment.STEPPED_BACK


def test_a_seq_that_drops_while_time_moves_on_starts_a_new_epoch() -> None:
    """A reboot: seq restarts at 0 while the clock moves forward. Not late: a new epoch."""
    device = Device()
    device.send(numbered(NOW, 5000, metrics={"temp": 45}), received=NOW)
    later = NOW + timedelta(seconds=30)
    hot = device.send(numbered(later, 0, metrics={"temp": 60}), received=later)
    assert hot.clock_adjustment is ClockAdjustment.SEQ_RESET
    assert hot.judged_at == later
    assert [f.rule_key for f in hot.firings] == ["hot"]
    assert device.state("hot").last_seq == 0
    # The new epoch goes on counting: its samples are in order again, nothing adjusted.
    cool = device.send(
        numbered(later + timedelta(seconds=1), 1, metrics={"temp": 30}),
        received=later + timedelta(seconds=1),
    )
    assert cool.clock_adjustment is None
    assert [c.rule_key for c in cool.clearings] == ["hot"]


def test_a_reboot_whose_clock_restarts_at_1970_is_a_new_epoch_in_arrival_order() -> None:
    device = Device()
    device.send(numbered(NOW, 5000, metrics={"temp": 60}), received=NOW)
    epoch = datetime(1970, 1, 1, 0, 0, 5, tzinfo=UTC)
    after = NOW + timedelta(seconds=30)
    cool = device.send(numbered(epoch, 0, metrics={"temp": 30}), received=after)
    assert cool.clock_adjustment is ClockAdjustment.BEHIND  # the time adjustment says more
    assert [c.rule_key for c in cool.clearings] == ["hot"]
    hot = device.send(
        numbered(epoch + timedelta(seconds=1), 1, metrics={"temp": 60}),
        received=after + timedelta(seconds=1),
    )
    assert [f.rule_key for f in hot.firings] == ["hot"]


def test_a_reordering_between_nodes_with_seq_stays_late() -> None:
    """seq 10 committed after seq 11, and dated before it too: late, as the ordering rule
    says (a late clear older than the alarm clears only the alarm of its time)."""
    device = Device()
    device.send(numbered(NOW, 9, metrics={"temp": 45}), received=NOW)
    hot = device.send(
        numbered(NOW + timedelta(seconds=2), 11, metrics={"temp": 60}),
        received=NOW + timedelta(seconds=3),
    )
    assert [f.rule_key for f in hot.firings] == ["hot"]
    late = device.send(
        numbered(NOW + timedelta(seconds=1), 10, metrics={"temp": 30}),
        received=NOW + timedelta(seconds=3),
    )
    assert late.clock_adjustment is None
    (clearing,) = late.clearings
    assert clearing.raised_by_then == NOW + timedelta(seconds=1)  # the alarm of its time
    assert device.state("hot").firing
    assert device.state("hot").last_seq == 11


def test_without_seq_a_clock_stepped_back_is_late_as_before() -> None:
    device = Device()
    device.send(temp(NOW, 30), received=NOW)
    stepped = device.send(temp(NOW - timedelta(minutes=2), 60), received=NOW)
    assert stepped.clock_adjustment is None
    # A late spike: its alarm is raised at its own time, already cleared by the newer sample.
    firing, clearing = stepped.outcomes
    assert firing.observed_at == NOW - timedelta(minutes=2)
    assert clearing.observed_at == NOW
    assert device.state("hot").last_ts == NOW


def test_event_rules_keep_the_seq_of_the_newest_sample() -> None:
    device = Device()
    device.send(numbered(NOW, 7, events=[{"type": "SOS"}]), received=NOW)
    assert device.state("sos").last_seq == 7
    device.send(numbered(NOW + timedelta(seconds=1), None, events=[{"type": "SOS"}]), received=NOW)
    assert device.state("sos").last_seq is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(
                st.sampled_from([{"temp": 30}, {"temp": 45}, {"temp": 60}]),
                st.just({"events": ["SOS"]}),
            ),
            st.integers(min_value=-150, max_value=20),
        ),
        min_size=1,
        max_size=15,
    )
)
def test_with_seq_counting_up_clock_steps_change_no_decision(
    drawn: list[tuple[dict[str, Any], int]],
) -> None:
    """A device whose seq counts up, whose clock steps back and forth (NTP), judged in
    arrival order: the same alarms are raised and cleared as for a device whose clock never
    stepped."""
    stepping, steady = Device(), Device()
    device_time = NOW
    for index, (body, step) in enumerate(drawn):
        device_time += timedelta(seconds=step)
        received = NOW + timedelta(hours=1, seconds=index)
        content: dict[str, Any] = (
            {"events": [{"type": "SOS"}]} if "events" in body else {"metrics": body}
        )
        a = stepping.send(numbered(device_time, index, **content), received=received)
        b = steady.send(
            numbered(NOW + timedelta(seconds=index), index, **content), received=received
        )
        assert [(type(o).__name__, o.rule_key) for o in a.outcomes] == [
            (type(o).__name__, o.rule_key) for o in b.outcomes
        ]
        assert [f.superseded_by_event for f in a.firings] == [
            f.superseded_by_event for f in b.firings
        ]
