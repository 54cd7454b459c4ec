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
    [
        name
        for name, kind in RuleState.__annotations__.items()
        # The newest sample's own device time is kept as it was sent: ahead is what it says.
        if "datetime" in str(kind) and name != "last_device_ts"
    ],
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


# --- clocks past the bounds, with seq, reordered between nodes -----------------------------
#
# A device whose clock is stuck at 1970 (or hours ahead) has every sample judged at its
# receipt. Another node may commit an older sample (lower seq, older own time) after a newer
# one, with a later receipt: it is late (its seq and its own time both say so), not a new
# epoch.

EPOCH = datetime(1970, 1, 1, 0, 0, 5, tzinfo=UTC)
BROKEN = {"1970": EPOCH, "8h ahead": NOW + timedelta(hours=8)}


def _broken_device(kind: str) -> tuple[Device, datetime]:
    """A device whose clock broke (a reboot to 1970, or set 8 hours ahead) after a sample of a
    good clock, and one sample since: its state judged at receipts, seq 0 the newest."""
    device = Device()
    device.send(numbered(NOW, 100, metrics={"temp": 45}), received=NOW)
    device.send(
        numbered(BROKEN[kind], 0, metrics={"temp": 45}), received=NOW + timedelta(seconds=30)
    )
    return device, BROKEN[kind]


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_violation_of_a_clock_past_the_bounds_committed_late_is_cleared_by_the_newer(
    kind: str,
) -> None:
    device, clock = _broken_device(kind)
    received = NOW + timedelta(seconds=40)
    cool = device.send(numbered(clock + timedelta(seconds=2), 2, metrics={"temp": 30}), received)
    assert cool.clock_adjustment in (ClockAdjustment.BEHIND, ClockAdjustment.AHEAD)
    # seq 1, dated before seq 2, committed after it by another node (a later receipt).
    hot = device.send(
        numbered(clock + timedelta(seconds=1), 1, metrics={"temp": 60}),
        received + timedelta(seconds=1),
    )
    # Late: its alarm is raised, already cleared by the newer sample; nothing stays active.
    assert hot.clock_adjustment in (ClockAdjustment.BEHIND, ClockAdjustment.AHEAD)
    assert hot.judged_at is not None
    assert hot.judged_at < received
    firing, clearing = hot.outcomes
    assert (type(firing).__name__, type(clearing).__name__) == ("Firing", "Clearing")
    assert clearing.observed_at == received
    state = device.state("hot")
    assert not state.firing
    assert (state.last_ts, state.last_seq, state.last_device_ts) == (
        received,
        2,
        clock + timedelta(seconds=2),
    )


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_clear_of_a_clock_past_the_bounds_committed_late_leaves_the_newer_violation(
    kind: str,
) -> None:
    device, clock = _broken_device(kind)
    received = NOW + timedelta(seconds=40)
    hot = device.send(numbered(clock + timedelta(seconds=2), 2, metrics={"temp": 60}), received)
    assert [f.rule_key for f in hot.firings] == ["hot"]
    cool = device.send(
        numbered(clock + timedelta(seconds=1), 1, metrics={"temp": 30}),
        received + timedelta(seconds=1),
    )
    assert cool.clock_adjustment is not ClockAdjustment.SEQ_RESET
    # Older than the alarm: it clears only the alarm of its time (none).
    (clearing,) = cool.clearings
    assert clearing.raised_by_then is not None
    assert clearing.raised_by_then < received
    assert device.state("hot").firing
    assert device.state("hot").last_seq == 2


def test_several_late_samples_of_a_stuck_clock_keep_their_seq_order() -> None:
    """A clock stuck at one time: seq alone orders; late samples are judged before the newest,
    one microsecond a seq."""
    device, _ = _broken_device("1970")
    received = NOW + timedelta(seconds=40)
    device.send(numbered(EPOCH, 5, metrics={"temp": 45}), received)
    late = [
        device.send(numbered(EPOCH, seq, metrics={"temp": 45}), received + timedelta(seconds=1))
        for seq in (3, 4)
    ]
    assert [e.judged_at for e in late] == [
        received - timedelta(microseconds=2),
        received - timedelta(microseconds=1),
    ]
    assert device.state("hot").last_seq == 5


def test_a_lower_seq_past_the_bounds_is_a_new_epoch_when_its_time_or_receipt_says_so() -> None:
    """A reboot to 1970 after more than reorder_window_s of uptime: its own time is further
    back than the window from the newest's; and a clock stuck at one time, rebooted: its
    receipt is later than the window after the newest's."""
    device, _ = _broken_device("1970")
    received = NOW + timedelta(seconds=40)
    device.send(numbered(EPOCH + timedelta(seconds=400), 7, metrics={"temp": 45}), received)
    rebooted = device.send(
        numbered(EPOCH, 0, metrics={"temp": 60}), received + timedelta(seconds=1)
    )
    assert rebooted.judged_at == received + timedelta(seconds=1)
    assert [f.rule_key for f in rebooted.firings] == ["hot"]
    assert device.state("hot").last_seq == 0
    stuck, _ = _broken_device("1970")
    stuck.send(numbered(EPOCH, 7, metrics={"temp": 45}), received)
    later = received + CLOCK.reorder_window + timedelta(seconds=1)
    again = stuck.send(numbered(EPOCH, 0, metrics={"temp": 60}), later)
    assert again.judged_at == later
    assert [f.rule_key for f in again.firings] == ["hot"]
    assert stuck.state("hot").last_seq == 0


# --- a clock ahead, corrected while its samples wait --------------------------------------
#
# A sample of a clock beyond max_future_skew is judged at its receipt; the samples the
# corrected clock sends after it are dated before that receipt when they wait (a broker
# outage, a slow drain). Without seq they are newer than it (arrival orders: its own time
# says nothing), judged at that receipt until their own time passes it.


@pytest.mark.parametrize("same_batch", [True, False])
def test_a_clock_ahead_corrected_while_its_samples_wait_clears_its_alarm(same_batch: bool) -> None:
    device = Device()
    receipt = NOW + timedelta(minutes=2)  # the batch's time: the backlog drains
    hot = device.send(temp(NOW + timedelta(hours=8), 60), received=receipt)
    assert hot.clock_adjustment is ClockAdjustment.AHEAD
    assert [f.rule_key for f in hot.firings] == ["hot"]
    # Sent after it, from the corrected clock, a minute before the receipt.
    later = receipt if same_batch else receipt + timedelta(seconds=1)
    cool = device.send(temp(NOW + timedelta(minutes=1), 30), received=later)
    assert not device.state("hot").firing
    (clearing,) = cool.clearings
    assert clearing.raised_by_then is None  # the firing alarm, not "the alarm of its time"
    assert cool.judged_at == receipt
    assert cool.clock_adjustment is ClockAdjustment.CORRECTED
    assert device.state("hot").last_device_ts == NOW + timedelta(minutes=1)
    # The next ones go on by their own time while it is before the receipt: newer is newer...
    again = device.send(temp(NOW + timedelta(minutes=1, seconds=1), 60), received=later)
    assert [f.rule_key for f in again.firings] == ["hot"]
    assert again.clock_adjustment is ClockAdjustment.CORRECTED
    # ... and older is late, as a reordering between nodes is.
    late = device.send(temp(NOW + timedelta(seconds=59), 30), received=later)
    assert late.clock_adjustment is None
    assert late.judged_at is None
    assert device.state("hot").firing
    # Once past the receipt, its own time again.
    past = device.send(temp(receipt + timedelta(seconds=1), 30), received=later)
    assert past.clock_adjustment is None
    assert [c.rule_key for c in past.clearings] == ["hot"]
    assert device.state("hot").last_device_ts is None


def test_a_clock_reset_to_1970_then_set_while_its_samples_wait_is_judged_in_order() -> None:
    device = Device()
    device.send(temp(NOW, 45), received=NOW)
    receipt = NOW + timedelta(minutes=2)
    hot = device.send(temp(EPOCH, 60), received=receipt)
    assert hot.clock_adjustment is ClockAdjustment.BEHIND
    # NTP sets the clock; its next sample, dated before the receipt, clears.
    cool = device.send(temp(NOW + timedelta(minutes=1), 30), received=receipt)
    assert not device.state("hot").firing
    assert [c.raised_by_then for c in cool.clearings] == [None]
    assert cool.clock_adjustment is ClockAdjustment.CORRECTED
