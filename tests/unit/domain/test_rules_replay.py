"""The reference model: one node reading a recorded stream in order (gateway/domain/replay.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gateway.domain.replay import Received, replay
from gateway.domain.rules import RuleConfig, compile_rules
from protocol import Telemetry, telemetry_event_id

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)

RULES = compile_rules(
    [
        RuleConfig(key="sos", kind="event", event="SOS", severity="CRITICAL"),
        RuleConfig(key="door", kind="event", event="DOOR_OPEN", severity="MAJOR"),
        RuleConfig(key="hot", kind="threshold", metric="temp", op=">", value=80, severity="MAJOR"),
        RuleConfig(
            key="held",
            kind="threshold",
            metric="p",
            op=">",
            value=10,
            for_seconds=20,
            severity="WARNING",
        ),
    ]
)


def sample(at: datetime, *, sent: datetime | None = None, **fields: object) -> Telemetry:
    ts = int(((sent or at) - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds() * 1000)
    events = fields.pop("events", None)
    return Telemetry(ts=ts, metrics=dict(fields) or None, events=events)  # type: ignore[arg-type]


def got(device: str, message: Telemetry, received_at: datetime) -> Received:
    return Received(device, received_at, message)


def test_each_event_occurrence_raises_an_alarm_that_supersedes_the_one_before() -> None:
    first = sample(T0, events=[{"type": "SOS"}])
    second = sample(T0 + timedelta(seconds=5), events=[{"type": "SOS"}])
    alarms = replay(RULES, [got("d1", first, T0), got("d1", second, T0 + timedelta(seconds=5))])
    assert [a.status for a in alarms] == ["SUPERSEDED", "OPEN"]
    assert alarms[0].superseded_by == telemetry_event_id("d1", second)


def test_a_threshold_fires_once_per_episode_and_its_clearing_sample_clears_it() -> None:
    values = [70, 95, 96, 70, 97]
    stream = [
        got("d1", sample(T0 + timedelta(seconds=i), temp=v), T0 + timedelta(seconds=i))
        for i, v in enumerate(values)
    ]
    alarms = replay(RULES, stream)
    assert len(alarms) == 2
    assert alarms[0].clear_event_id == telemetry_event_id("d1", stream[3].message)
    # Nobody attended the cleared alarm: the next episode's alarm supersedes it.
    assert alarms[0].status == "SUPERSEDED"
    assert alarms[1].status == "OPEN"
    assert alarms[1].clear_event_id is None


def test_a_clock_hours_ahead_does_not_hide_the_next_real_occurrence() -> None:
    ahead = sample(T0, sent=T0 + timedelta(hours=8), events=[{"type": "SOS"}])
    real = sample(T0 + timedelta(seconds=10), events=[{"type": "SOS"}])
    alarms = replay(RULES, [got("d1", ahead, T0), got("d1", real, T0 + timedelta(seconds=10))])
    assert [a.status for a in alarms] == ["SUPERSEDED", "OPEN"]
    assert alarms[0].sample_ts == T0  # judged at its receipt
    assert not alarms[1].late


def test_the_hold_timer_fires_a_held_violation_with_no_further_sample() -> None:
    only = sample(T0, p=15)
    assert replay(RULES, [got("d1", only, T0)], until=T0 + timedelta(seconds=19)) == []
    alarms = replay(RULES, [got("d1", only, T0)], until=T0 + timedelta(seconds=20))
    assert [(a.rule_key, a.sample_ts) for a in alarms] == [("held", T0 + timedelta(seconds=20))]


def test_a_hold_is_judged_before_the_next_message_at_its_receipt() -> None:
    stream = [
        got("d1", sample(T0, p=15), T0),
        got("d1", sample(T0 + timedelta(seconds=60), p=5), T0 + timedelta(seconds=60)),
    ]
    alarms = replay(RULES, stream)
    assert len(alarms) == 1
    assert alarms[0].clear_event_id == telemetry_event_id("d1", stream[1].message)


def test_a_late_event_is_created_superseded_by_the_open_alarm_raised_since() -> None:
    older = sample(T0, events=[{"type": "DOOR_OPEN"}])
    newer = sample(T0 + timedelta(seconds=5), events=[{"type": "DOOR_OPEN"}])
    at = T0 + timedelta(seconds=6)
    alarms = replay(RULES, [got("d1", newer, at), got("d1", older, at)])
    assert [(a.status, a.late) for a in alarms] == [("OPEN", False), ("SUPERSEDED", True)]


def test_devices_are_replayed_apart_so_one_device_s_receipts_fire_no_other_s_hold() -> None:
    stream = [
        got("d1", sample(T0, p=15), T0),
        # d2's receipt is past d1's hold, but d1's next sample (at T0 + 5) cleared it first.
        got("d2", sample(T0 + timedelta(seconds=40), temp=70), T0 + timedelta(seconds=40)),
        got("d1", sample(T0 + timedelta(seconds=5), p=5), T0 + timedelta(seconds=5)),
    ]
    assert replay(RULES, stream) == []
