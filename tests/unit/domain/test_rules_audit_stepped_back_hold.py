"""A `for_seconds` hold across a clock stepped back within the bounds (pure part): between two
samples whose own times are within the bounds, the device's clock measures the hold, also
while they are judged at the newest time already judged (`stepped_back`, `corrected`), and as
the clock catches up; a sample whose own time is past the bounds measures nothing."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.domain.rules import (
    IDLE,
    ClockAdjustment,
    DeviceClock,
    Evaluation,
    RuleConfig,
    RuleState,
    RuleStates,
    compile_rules,
    evaluate,
    state_keys,
)
from protocol import Telemetry

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
CLOCK = DeviceClock(max_future_skew=timedelta(seconds=300), reorder_window=timedelta(seconds=300))
RULES = compile_rules(
    [
        msgspec.convert(
            {"key": "hot", "kind": "threshold", "metric": "temp", "op": ">", "value": 50,
             "for_seconds": 60, "severity": "CRITICAL"},
            RuleConfig,
        )
    ]
)  # fmt: skip


class Device:
    """One device's samples judged in arrival order, each at its receipt."""

    def __init__(self) -> None:
        self.states: RuleStates = {}
        self.count = 0

    def send(self, ts: datetime, seq: int | None, temp: float, received: datetime) -> Evaluation:
        self.count += 1
        message = Telemetry(ts=ts, seq=seq, metrics={"temp": temp})
        keys = state_keys(RULES, "dev-1", message)
        batch = {key: self.states[key] for key in keys if key in self.states}
        evaluation = evaluate(
            RULES, batch, "dev-1", f"ev-{self.count}", message, received_at=received, clock=CLOCK
        )
        self.states.update(batch)
        return evaluation

    @property
    def state(self) -> RuleState:
        return self.states.get(("dev-1", "hot"), IDLE)

    def held(self) -> timedelta:
        state = self.state
        assert state.pending_since is not None
        assert state.last_ts is not None
        return state.last_ts - state.pending_since


def test_the_hold_counts_the_stepped_back_clock_and_its_catching_up_exactly() -> None:
    device = Device()
    device.send(NOW + timedelta(seconds=40), 1, 30, received=NOW)  # 40 s ahead
    # Stepped back: 95 from NOW, every 15 s by its own clock, judged at NOW + 40 s until it
    # passes it.
    for n in range(3):
        hot = device.send(NOW + timedelta(seconds=15 * n), 2 + n, 95, NOW + timedelta(seconds=n))
        assert hot.clock_adjustment is ClockAdjustment.STEPPED_BACK
        assert hot.firings == ()
        assert device.held() == timedelta(seconds=15 * n)
    # Past it (its own time again): 45 s held by its clock, not 5 s past the pinned time.
    caught_up = device.send(NOW + timedelta(seconds=45), 5, 95, NOW + timedelta(seconds=3))
    assert caught_up.clock_adjustment is None
    assert device.held() == timedelta(seconds=45)
    (fired,) = device.send(NOW + timedelta(seconds=60), 6, 95, NOW + timedelta(seconds=4)).firings
    assert fired.observed_at == NOW + timedelta(seconds=60)


def test_the_step_itself_and_a_step_back_again_count_nothing() -> None:
    device = Device()
    device.send(NOW + timedelta(seconds=100), 1, 95, received=NOW)  # pending, 100 s ahead
    # The step: how long passed between the two is unknown.
    device.send(NOW, 2, 95, received=NOW + timedelta(seconds=1))
    assert device.held() == timedelta(0)
    device.send(NOW + timedelta(seconds=20), 3, 95, received=NOW + timedelta(seconds=2))
    assert device.held() == timedelta(seconds=20)
    # Stepped back again, before its previous sample: nothing more.
    device.send(NOW + timedelta(seconds=5), 4, 95, received=NOW + timedelta(seconds=3))
    assert device.held() == timedelta(seconds=20)


def test_a_clock_reset_to_1970_and_then_set_counts_nothing_of_its_reset_time() -> None:
    device = Device()
    device.send(NOW, 1, 30, received=NOW)
    received = NOW + timedelta(seconds=30)
    reset = device.send(datetime(1970, 1, 1, 0, 0, 9, tzinfo=UTC), 2, 95, received=received)
    assert reset.clock_adjustment is ClockAdjustment.BEHIND  # judged at its receipt
    # Set right, dated before that receipt: judged at it, and the 1970 time measures nothing.
    right = device.send(received - timedelta(seconds=5), 3, 95, received + timedelta(seconds=1))
    assert right.clock_adjustment is ClockAdjustment.STEPPED_BACK
    assert right.firings == ()
    assert device.held() == timedelta(0)


def test_a_clock_past_the_skew_counts_nothing_of_its_time_ahead() -> None:
    device = Device()
    device.send(NOW, 1, 30, received=NOW)
    received = NOW + timedelta(seconds=30)
    ahead = device.send(NOW + timedelta(hours=8), 2, 95, received=received)
    assert ahead.clock_adjustment is ClockAdjustment.AHEAD  # judged at its receipt
    right = device.send(received - timedelta(seconds=5), 3, 95, received + timedelta(seconds=1))
    assert right.clock_adjustment is ClockAdjustment.STEPPED_BACK
    assert device.held() == timedelta(0)
    # Its next sample, within the bounds as the one before: their time between counts.
    device.send(received + timedelta(seconds=5), 4, 95, received + timedelta(seconds=2))
    assert device.held() == timedelta(seconds=10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-100, max_value=30), min_size=1, max_size=15))
def test_a_hold_never_counts_more_than_the_devices_own_clock(steps: list[int]) -> None:
    """A clock stepping back and forth within the bounds (NTP) while seq counts up, every
    sample violating: the hold at each sample is at most the device's own time gone forward
    between the run's samples (a step back counts nothing), and it fires only once that is
    `for_seconds`."""
    device = Device()
    sent = NOW
    own: list[datetime] = []
    for index, step in enumerate(steps):
        received = NOW + timedelta(seconds=index)
        # Within 120 s of its receipt either way: inside both bounds throughout.
        sent = min(max(sent + timedelta(seconds=step), received - timedelta(seconds=120)),
                   received + timedelta(seconds=120))  # fmt: skip
        own.append(sent)
        evaluation = device.send(sent, index, 95, received)
        forward = sum((max(timedelta(0), b - a) for a, b in itertools.pairwise(own)), timedelta(0))
        if evaluation.firings:
            assert forward >= timedelta(seconds=60)
            return
        assert device.held() <= forward
