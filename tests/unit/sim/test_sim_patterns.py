"""Simulated devices' telemetry patterns, the mix, and the rate schedule: pure, seeded."""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

import pytest

from protocol import Encoding, Telemetry, decode_telemetry, encode_telemetry
from sim.devices import FleetConfig, FleetStats, Pacer, Summary, default_max_lag, progress_line
from sim.patterns import (
    DEFAULT_MIX,
    EVENT_TYPES,
    MAX_DEVICES,
    Pattern,
    PatternParams,
    SimDevice,
    assign_patterns,
    check_device_count,
    fleet,
    mix_summary,
    parse_mix,
    pattern_counts,
)
from sim.telemetry import device_ids

T0 = 1_767_225_600_000
STEP_MS = 1_000


def _run(device: SimDevice, samples: int, *, step_ms: int = STEP_MS) -> list[Telemetry | None]:
    return [device.next_message(T0 + n * step_ms) for n in range(samples)]


def _device(pattern: Pattern, **params: Any) -> SimDevice:
    return SimDevice("dev-1", pattern, PatternParams(**params), random.Random(7))


def _payloads(seed: int, turns: int = 2_000) -> list[bytes | None]:
    devices = fleet(device_ids(50), parse_mix(DEFAULT_MIX), seed=seed, params=PatternParams())
    out: list[bytes | None] = []
    for turn in range(turns):
        message = devices[turn % len(devices)].next_message(T0 + turn * 10)
        out.append(None if message is None else encode_telemetry(message))
    return out


# --- determinism, seq, encoding -----------------------------------------------------------------


def test_the_same_seed_gives_the_same_messages_and_another_seed_others() -> None:
    first = _payloads(seed=3)
    assert first == _payloads(seed=3)
    assert first != _payloads(seed=4)
    assert sum(payload is not None for payload in first) > 1_900


@pytest.mark.parametrize("pattern", list(Pattern))
def test_seq_strictly_increases_and_ts_is_the_time_passed(pattern: Pattern) -> None:
    device = _device(pattern, active_messages=3, silence_s=5, event_probability=0.3)
    sent = [m for m in _run(device, 400) if m is not None]
    assert len(sent) > 100
    seqs = [m.seq for m in sent]
    assert seqs == list(range(len(sent)))
    stamps = [m.ts for m in sent]
    assert stamps == sorted(set(stamps))
    assert all(isinstance(ts, int) and (ts - T0) % STEP_MS == 0 for ts in stamps)


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("pattern", list(Pattern))
def test_every_message_round_trips_through_the_wire_codec(
    pattern: Pattern, encoding: Encoding
) -> None:
    device = _device(pattern, event_probability=0.3, crossing_probability=0.1)
    for message in _run(device, 100):
        if message is not None:
            assert decode_telemetry(encode_telemetry(message, encoding), encoding) == message


# --- event patterns -----------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", list(EVENT_TYPES))
def test_each_event_is_cleared_by_its_own_clear_event_before_it_happens_again(
    pattern: Pattern,
) -> None:
    opened, cleared = EVENT_TYPES[pattern]
    device = _device(pattern, event_probability=0.2, clear_after=(2, 5))
    messages = [m for m in _run(device, 3_000) if m is not None]
    events = [(n, m.event_types()) for n, m in enumerate(messages) if m.events]
    assert all(len(types) == 1 for _, types in events)
    types = [types[0] for _, types in events]
    assert len(types) > 100
    assert types[0] == opened
    # Alternating: never two opens (or two clears) in a row.
    assert types == [opened, cleared] * (len(types) // 2) + [opened] * (len(types) % 2)
    # The clear comes 2..5 messages after its event; readings in between carry the battery.
    gaps = [events[i + 1][0] - events[i][0] for i in range(0, len(events) - 1, 2)]
    assert set(gaps) <= {2, 3, 4, 5}
    assert len(set(gaps)) > 1
    readings = [m for m in messages if not m.events]
    assert readings
    assert all(m.metrics is not None and set(m.metrics) == {"battery"} for m in readings)


def test_the_event_pairs_are_the_ones_the_spec_names() -> None:
    assert dict(EVENT_TYPES) == {
        Pattern.DOOR: ("DOOR_OPEN", "DOOR_CLOSE"),
        Pattern.SOS: ("SOS", "SOS_CLEAR"),
        Pattern.SMOKE: ("SMOKE", "SMOKE_CLEAR"),
        Pattern.WATER_LEAK: ("WATER_LEAK", "WATER_LEAK_CLEAR"),
        Pattern.POWER: ("POWER_OFF", "POWER_ON"),
    }


def test_no_event_without_event_probability() -> None:
    messages = _run(_device(Pattern.DOOR, event_probability=0.0), 500)
    assert not any(m is not None and m.events for m in messages)


# --- the random walk ----------------------------------------------------------------------------


def _temps(device: SimDevice, samples: int) -> list[float]:
    temps = []
    for message in _run(device, samples):
        assert message is not None
        assert message.metrics is not None
        assert set(message.metrics) == {"temp", "humidity", "battery"}
        temp = message.metrics["temp"]
        assert isinstance(temp, float)
        temps.append(temp)
    return temps


def test_walk_crosses_above_the_threshold_and_back_below_the_clear_value() -> None:
    temps = _temps(_device(Pattern.WALK, crossing_probability=0.02), 2_000)
    above = [n for n, temp in enumerate(temps) if temp > 80]
    assert above, "at least one crossing above 80"
    assert any(temp < 75 for temp in temps[above[0] :]), "and back below 75"
    # A clean edge either way: no sample in the hysteresis band, so rules fire and clear.
    assert not any(75 <= temp <= 80 for temp in temps)
    crossings = sum(1 for n in range(1, len(temps)) if temps[n] > 80 >= temps[n - 1])
    assert 10 <= crossings <= 80  # ~2% of 2,000 samples
    assert min(temps) > 0


def test_walk_without_crossing_probability_stays_below_the_clear_value() -> None:
    temps = _temps(_device(Pattern.WALK, crossing_probability=0.0), 5_000)
    assert max(temps) < 75


def test_battery_drains_slowly_and_never_goes_negative() -> None:
    device = _device(Pattern.WALK, battery_drain=0.5)
    batteries = []
    for message in _run(device, 400):
        assert message is not None
        assert message.metrics is not None
        battery = message.metrics["battery"]
        assert isinstance(battery, float)
        batteries.append(battery)
    assert batteries == sorted(batteries, reverse=True)
    assert batteries[-1] == 0.0
    assert batteries[0] > 50


# --- silence ------------------------------------------------------------------------------------


def test_a_silent_device_goes_quiet_for_the_configured_time_then_resumes() -> None:
    device = _device(Pattern.SILENT, active_messages=5, silence_s=60)
    messages = _run(device, 300)  # one turn per second
    sent_at = [n for n, m in enumerate(messages) if m is not None]
    # Five messages, nothing for 60 s, five again, ... (each silence starts at a turn).
    assert sent_at[:5] == [0, 1, 2, 3, 4]
    gaps = [b - a for a, b in itertools.pairwise(sent_at) if b - a > 1]
    assert gaps
    # The last message, the turn that finds the device silent, and 60 s after that turn.
    assert all(gap == 61 for gap in gaps), gaps
    assert len(sent_at) > 20
    temps = [m.metrics["temp"] for m in messages if m is not None and m.metrics]
    assert len(temps) == len(sent_at)
    # No spikes: silence is what this device is for.
    assert all(isinstance(temp, float) and temp < 75 for temp in temps)


def test_silence_is_measured_on_the_time_passed_not_on_turns() -> None:
    device = _device(Pattern.SILENT, active_messages=1, silence_s=10)
    assert device.next_message(T0) is not None
    assert device.next_message(T0 + 1) is None  # the silence starts here
    assert device.next_message(T0 + 10_000) is None
    assert device.next_message(T0 + 10_001) is not None


# --- the mix ------------------------------------------------------------------------------------


def test_parse_mix_accepts_weights_in_order_with_spaces_and_zeroes() -> None:
    assert parse_mix(DEFAULT_MIX) == {
        Pattern.WALK: 70, Pattern.DOOR: 10, Pattern.SOS: 5, Pattern.SMOKE: 5,
        Pattern.WATER_LEAK: 5, Pattern.POWER: 3, Pattern.SILENT: 2,
    }  # fmt: skip
    mix = parse_mix(" door = 1.5 , walk=0,silent=2 ")
    assert list(mix.items()) == [(Pattern.DOOR, 1.5), (Pattern.WALK, 0.0), (Pattern.SILENT, 2.0)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the mix is empty"),
        (" , ", "the mix is empty"),
        ("walk", "mix entry 'walk' is not name=weight"),
        ("walk=", "mix entry 'walk=' is not name=weight"),
        ("=5", "mix entry '=5' is not name=weight"),
        ("walk=1,,door=1", "mix entry '' is not name=weight"),
        ("fog=3", "unknown pattern 'fog' in the mix; known: walk, door, sos, smoke, water_leak"),
        ("walk=1,walk=2", "pattern 'walk' appears twice"),
        ("walk=lots", "weight of 'walk' is not a number: 'lots'"),
        ("walk=-1", "weight of 'walk' must be a finite number >= 0, got -1"),
        ("walk=nan", "weight of 'walk' must be a finite number >= 0"),
        ("walk=inf", "weight of 'walk' must be a finite number >= 0"),
        ("walk=0,door=0", "the mix needs at least one weight above 0"),
    ],
)
def test_parse_mix_rejects_bad_strings_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_mix(text)


def test_pattern_counts_follow_the_weights_and_sum_to_the_devices() -> None:
    mix = parse_mix(DEFAULT_MIX)
    assert pattern_counts(100, mix) == {
        Pattern.WALK: 70, Pattern.DOOR: 10, Pattern.SOS: 5, Pattern.SMOKE: 5,
        Pattern.WATER_LEAK: 5, Pattern.POWER: 3, Pattern.SILENT: 2,
    }  # fmt: skip
    # Largest remainders, ties to the earlier pattern of the mix.
    assert pattern_counts(10, mix) == {
        Pattern.WALK: 7, Pattern.DOOR: 1, Pattern.SOS: 1, Pattern.SMOKE: 1,
        Pattern.WATER_LEAK: 0, Pattern.POWER: 0, Pattern.SILENT: 0,
    }  # fmt: skip
    assert pattern_counts(1, mix)[Pattern.WALK] == 1
    for count in (1, 2, 3, 7, 99, 1_001, MAX_DEVICES):
        assert sum(pattern_counts(count, mix).values()) == count
    assert pattern_counts(4, parse_mix("walk=1,door=1")) == {Pattern.WALK: 2, Pattern.DOOR: 2}


def test_assign_patterns_is_a_seeded_shuffle_of_the_counts() -> None:
    mix = parse_mix(DEFAULT_MIX)
    first = assign_patterns(1_000, mix, seed=1)
    assert first == assign_patterns(1_000, mix, seed=1)
    assert first != assign_patterns(1_000, mix, seed=2)
    assert mix_summary(first) == {p: n for p, n in pattern_counts(1_000, mix).items() if n}
    devices = fleet(device_ids(1_000), mix, seed=1, params=PatternParams())
    assert [d.pattern for d in devices] == first
    assert devices[3].device_id == "sim-00003"


@pytest.mark.parametrize("count", [0, -1, MAX_DEVICES + 1])
def test_device_counts_outside_1_to_50000_are_refused(count: int) -> None:
    with pytest.raises(ValueError, match=r"within 1\.\.50000"):
        check_device_count(count)
    with pytest.raises(ValueError, match=r"within 1\.\.50000"):
        FleetConfig(devices=count)


def test_a_fleet_of_the_largest_size_builds() -> None:
    devices = fleet(device_ids(MAX_DEVICES), parse_mix(DEFAULT_MIX), seed=1, params=PatternParams())
    assert len(devices) == MAX_DEVICES
    assert devices[-1].device_id == "sim-49999"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"crossing_probability": 1.5}, "crossing_probability must be within"),
        ({"event_probability": -0.1}, "event_probability must be within"),
        ({"threshold": 70.0}, "threshold"),
        ({"clear_after": (0, 3)}, "clear_after must be a range"),
        ({"spike_samples": (3, 2)}, "spike_samples must be a range"),
        ({"active_messages": 0}, "active_messages must be at least 1"),
        ({"silence_s": 0}, "silence_s must be"),
        ({"battery_drain": -1.0}, "battery_drain must be"),
    ],
)
def test_pattern_params_are_validated(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PatternParams(**params)  # type: ignore[arg-type]  # bad values on purpose


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rate": 0.0}, "rate must be"),
        ({"rate": float("inf")}, "rate must be"),
        ({"duration_s": 0.0}, "duration must be"),
        ({"messages": 0}, "messages must be at least 1"),
        ({"window": 0}, "window must be at least 1"),
    ],
)
def test_fleet_config_is_validated(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetConfig(**fields)  # type: ignore[arg-type]  # bad values on purpose


# --- the rate schedule --------------------------------------------------------------------------


def test_pacer_hands_out_turns_at_the_rate() -> None:
    pacer = Pacer(rate=10.0, start_s=100.0, max_lag=100)
    assert pacer.due(99.0) == 0
    assert pacer.due(100.0) == 1  # turn 0 at the start
    assert pacer.due(100.05) == 0
    assert pacer.next_due_s() == pytest.approx(100.1)
    assert pacer.due(100.1) == 1
    assert pacer.due(100.35) == 2  # turns 2 and 3
    assert pacer.next_due_s() == pytest.approx(100.4)
    assert pacer.due(pacer.next_due_s()) == 1  # exactly on time is due, float error or not
    assert pacer.due(102.0) == 16  # turns 5..20
    assert (pacer.taken, pacer.dropped) == (21, 0)


def test_pacer_drops_turns_further_behind_than_max_lag() -> None:
    pacer = Pacer(rate=100.0, start_s=0.0, max_lag=default_max_lag(100.0))
    assert pacer.due(0.0) == 1
    # Ten seconds stalled (a slow or absent broker): one second of turns, not ten, and the
    # schedule goes on from now instead of bursting.
    assert pacer.due(10.0) == 100
    assert pacer.dropped == 900
    assert pacer.due(10.005) == 0
    assert pacer.due(10.01) == 1
    # Turns handed out but not used (stopping, or the connection dropped) are due again.
    pacer.untake(1)
    assert pacer.due(10.012) == 1
    assert pacer.dropped == 900
    assert default_max_lag(0.5) == 1
    assert default_max_lag(2_500.2) == 2_501


def test_pacer_over_a_long_run_gives_rate_times_duration() -> None:
    pacer = Pacer(rate=333.0, start_s=5.0, max_lag=1_000)
    turns = sum(pacer.due(5.0 + tick / 1_000) for tick in range(60_000))  # 60 s, 1 ms ticks
    assert turns == 333 * 60  # turns 0 .. floor(59.999 * 333)


@pytest.mark.parametrize(("rate", "max_lag"), [(0.0, 1), (-1.0, 1), (float("nan"), 1), (1.0, 0)])
def test_pacer_refuses_a_bad_rate_or_lag(rate: float, max_lag: int) -> None:
    with pytest.raises(ValueError, match=r"rate|max_lag"):
        Pacer(rate=rate, start_s=0.0, max_lag=max_lag)


# --- what the operator reads --------------------------------------------------------------------


def test_progress_line_and_summary_name_every_figure() -> None:
    stats = FleetStats(sent=250, publish_errors=1, connection_errors=2, silent_turns=3,
                       dropped_turns=4, commands=5, receipts=6, responder_errors=7)  # fmt: skip
    assert progress_line(stats, 99.5) == (
        "    99.5 msg/s | sent 250 | commands 5 | receipts 6 | errors 10"
    )
    summary = Summary(
        devices=3, mix={Pattern.WALK: 2, Pattern.DOOR: 1}, duration_s=2.5, target_rate=100,
        stats=stats, commands_enabled=True,
    )  # fmt: skip
    assert summary.achieved_rate == 100.0
    text = summary.render()
    assert "devices    3 (walk 2, door 1)" in text
    assert "duration   2.50 s" in text
    assert "sent       250 messages, 100.0 msg/s (target 100 msg/s)" in text
    assert "turns      3 silent, 4 dropped" in text
    assert "commands   5 received, 6 answered" in text
    assert "errors     10 (publish 1, connection 2, responder 7)" in text
