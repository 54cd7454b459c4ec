"""Device time is evidence, not truth: the bounds within which it orders a device's samples
(issue: a clock set ahead hid a CRITICAL SOS; a clock reset to 1970 held a rule's state)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest

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


def test_inside_the_bounds_the_ordering_rule_is_unchanged() -> None:
    """Two nodes committing one device's samples out of order, seconds apart: a late event
    older than the alarm raised since is still created superseded by it."""
    device = Device()
    device.send(sos(NOW + timedelta(seconds=20)), received=NOW + timedelta(seconds=21))
    late = device.send(sos(NOW + timedelta(seconds=10)), received=NOW + timedelta(seconds=22))
    assert late.clock_adjustment is None
    (firing,) = late.firings
    assert firing.superseded_by_event == "ev-1"
