"""`for_seconds` on a clock (pure part): when a pending violation's hold is due with no further
sample, and what firing it writes. The hold runs on the row's timeline: device time up to the
newest sample, then database time since that sample's batch wrote the row."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gateway.domain.rules import (
    RuleConfig,
    RuleState,
    ThresholdRule,
    compile_rule,
    evaluate,
    fire_held,
    hold_due_at,
    hold_event_id,
)
from gateway.domain.rules import RuleSet as RuleSetType
from protocol import Telemetry

DB_NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
DEVICE_T = datetime(2026, 6, 1, 10, 0, tzinfo=UTC)  # a device clock two hours behind


def _rule(**fields: object) -> ThresholdRule:
    config = RuleConfig(key="hot", kind="threshold", metric="temp", op=">", value=50,
                        severity="MAJOR", **fields)  # type: ignore[arg-type]  # fmt: skip
    rule = compile_rule(config)
    assert isinstance(rule, ThresholdRule)
    return rule


def _pending(count: int = 1, since: datetime = DEVICE_T, last: datetime = DEVICE_T) -> RuleState:
    return RuleState(pending_count=count, pending_since=since, last_ts=last)


def test_the_hold_runs_from_the_write_of_the_sample_whatever_its_device_time() -> None:
    rule = _rule(for_seconds=60)
    assert hold_due_at(rule, _pending(), DB_NOW) == DB_NOW + timedelta(seconds=60)


def test_device_time_already_held_counts_towards_the_hold() -> None:
    rule = _rule(for_seconds=60)
    state = _pending(count=3, last=DEVICE_T + timedelta(seconds=45))
    assert hold_due_at(rule, state, DB_NOW) == DB_NOW + timedelta(seconds=15)


@pytest.mark.parametrize(
    ("rule", "state"),
    [
        (_rule(), _pending()),  # no hold
        (_rule(for_seconds=60), RuleState()),  # not pending
        (_rule(for_seconds=60), RuleState(firing=True, last_ts=DEVICE_T)),
        (_rule(for_seconds=60, for_samples=3), _pending(count=2)),  # samples still to come
    ],
)
def test_nothing_for_the_timer(rule: ThresholdRule, state: RuleState) -> None:
    assert hold_due_at(rule, state, DB_NOW) is None
    assert fire_held(rule, "d1", state, written_at=DB_NOW, now=DB_NOW + timedelta(days=1)) is None


def test_fire_held_fires_when_due_and_not_before() -> None:
    rule = _rule(for_seconds=60)
    state = _pending()
    early = DB_NOW + timedelta(seconds=59)
    assert fire_held(rule, "d1", state, written_at=DB_NOW, now=early) is None
    judged = fire_held(rule, "d1", state, written_at=DB_NOW, now=DB_NOW + timedelta(seconds=60))
    assert judged is not None
    firing, fired = judged
    assert firing.rule_key == "hot"
    assert firing.device_id == "d1"
    assert firing.telemetry_event_id == hold_event_id("hot", "d1", DEVICE_T)
    assert firing.observed_at == DEVICE_T + timedelta(seconds=60)
    assert firing.trigger is not None
    assert firing.trigger["sample_ts"] == (DEVICE_T + timedelta(seconds=60)).isoformat()
    assert firing.trigger["pending_since"] == DEVICE_T.isoformat()
    assert "held 60s" in firing.reason
    assert fired.firing
    assert (fired.pending_count, fired.pending_since) == (0, None)
    assert fired.fired_ts == DEVICE_T + timedelta(seconds=60)
    assert fired.fired_event_id == firing.telemetry_event_id
    assert fired.last_ts == DEVICE_T  # no sample was judged


def test_a_device_the_rule_no_longer_selects_is_not_fired() -> None:
    rule = _rule(for_seconds=60, devices="boiler-*")
    later = DB_NOW + timedelta(minutes=5)
    assert fire_held(rule, "pump-1", _pending(), written_at=DB_NOW, now=later) is None
    assert fire_held(rule, "boiler-1", _pending(), written_at=DB_NOW, now=later) is not None


def test_the_same_hold_has_the_same_event_id_on_every_node() -> None:
    assert hold_event_id("hot", "d1", DEVICE_T) == hold_event_id("hot", "d1", DEVICE_T)
    assert hold_event_id("hot", "d1", DEVICE_T) != hold_event_id(
        "hot", "d1", DEVICE_T + timedelta(seconds=1)
    )


def test_after_the_timer_fired_a_violating_sample_raises_nothing_and_a_clear_clears() -> None:
    rule = _rule(for_seconds=60, clear_value=40)
    rules = RuleSetType([rule])
    judged = fire_held(rule, "d1", _pending(), written_at=DB_NOW, now=DB_NOW + timedelta(hours=1))
    assert judged is not None
    states = {("d1", "hot"): judged[1]}
    still = Telemetry(ts=DEVICE_T + timedelta(seconds=90), metrics={"temp": 60})
    assert evaluate(rules, states, "d1", "e1", still).outcomes == ()
    back = Telemetry(ts=DEVICE_T + timedelta(seconds=120), metrics={"temp": 30})
    assert len(evaluate(rules, states, "d1", "e2", back).clearings) == 1


def test_a_clear_dated_before_the_hold_completed_but_arriving_after_it_clears_the_alarm() -> None:
    """The device cleared in time, but its sample came after the timer had fired: the alarm
    stands raised and cleared (a late sample, older than the newest judged, would not)."""
    rule = _rule(for_seconds=60, clear_value=40)
    rules = RuleSetType([rule])
    state = _pending(count=2, last=DEVICE_T + timedelta(seconds=10))
    judged = fire_held(rule, "d1", state, written_at=DB_NOW, now=DB_NOW + timedelta(hours=1))
    assert judged is not None
    states = {("d1", "hot"): judged[1]}
    late = Telemetry(ts=DEVICE_T + timedelta(seconds=5), metrics={"temp": 30})
    # Only an alarm raised by a sample at or before it (the hold's is dated +60 s).
    (older,) = evaluate(rules, dict(states), "d1", "e1", late).clearings
    assert older.raised_by_then == DEVICE_T + timedelta(seconds=5)
    back = Telemetry(ts=DEVICE_T + timedelta(seconds=30), metrics={"temp": 30})
    assert len(evaluate(rules, states, "d1", "e2", back).clearings) == 1
