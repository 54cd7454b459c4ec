"""The benchmark's phases date their samples one stretch after another (``sim.telemetry.Timeline``):
each phase's samples, read back as the gateway reads them, come after every earlier phase's, so
that a phase appends to the telemetry the earlier ones stored instead of writing between their
rows. What each phase takes of the timeline is the span its stream really covers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.config import parse_config
from gateway.domain.mappings import MappedTelemetry
from protocol import Topics, decode_telemetry, sparkplug
from sim.bench import DEVICES, SHARED_DEVICES, backlog_span_ms
from sim.bench_live import STORM_SPAN_MS
from sim.sparkplug import sparkplug_stream
from sim.telemetry import (
    EPOCH_MS,
    PHASE_GAP_MS,
    Timeline,
    device_ids,
    hysteresis_stream,
    telemetry_stream,
)
from sim.vendor import vendor_stream

# Every format a full run drains, each as its own phase.
FORMATS = ("native", "tasmota", "sparkplug", "zigbee2mqtt", "shelly-gen2", "chirpstack-v4")


def _times(fmt: str, stream: Iterator[tuple[str, bytes]]) -> list[int]:
    """Each message's sample time (ms) as the gateway reads it."""
    if fmt == "native":
        return [decode_telemetry(payload).ts for _, payload in stream]
    if fmt == "sparkplug":
        times = []
        for _, payload in stream:
            stamp = sparkplug.decode_payload(payload).timestamp
            assert stamp is not None
            times.append(stamp)
        return times
    mappings = parse_config(f'[[ingest.mappings]]\nname = "m"\nprofile = "{fmt}"\n').mappings()
    times = []
    for topic, payload in stream:
        read = mappings.read(topic, payload, EPOCH_MS)
        assert isinstance(read, MappedTelemetry), read
        times.append(read.message.ts)
    return times


# Zigbee2MQTT's readings carry no time: the gateway dates them on receipt (now, after any
# stretch of the fixed epoch), so its phase takes no time of the run's.
DATED = tuple(f for f in FORMATS if f != "zigbee2mqtt")


def _phase(fmt: str, messages: int, epoch_ms: int) -> list[int]:
    devices = device_ids(DEVICES, f"p-{fmt}")
    if fmt == "native":
        return _times(fmt, telemetry_stream(Topics("p"), devices, messages, epoch_ms=epoch_ms))
    if fmt == "sparkplug":
        return _times(fmt, sparkplug_stream(devices, messages, epoch_ms=epoch_ms))
    return _times(fmt, vendor_stream(fmt, devices, messages, epoch_ms=epoch_ms))


@pytest.mark.parametrize("fmt", DATED)
@pytest.mark.parametrize("messages", [1, 2 * DEVICES + 500, 3 * DEVICES])
def test_a_phase_takes_the_span_its_samples_cover(fmt: str, messages: int) -> None:
    # Up to and past whole rounds of the devices: Tasmota's clock counts whole seconds a round.
    times = _phase(fmt, messages, epoch_ms=EPOCH_MS)
    assert min(times) == EPOCH_MS
    assert max(times) - min(times) == backlog_span_ms(messages, fmt=fmt)


def test_a_phase_of_readings_without_a_time_takes_none() -> None:
    assert backlog_span_ms(5_000, fmt="zigbee2mqtt") == 0


def test_the_live_phases_take_the_span_of_their_hysteresis() -> None:
    messages, period = 3 * SHARED_DEVICES + 7, 2
    devices = device_ids(SHARED_DEVICES, "live")
    stream = hysteresis_stream(Topics("p"), devices, messages, period=period, epoch_ms=EPOCH_MS)
    times = _times("native", stream)
    assert (min(times), max(times)) == (EPOCH_MS, EPOCH_MS + 3000)
    assert max(times) - min(times) == backlog_span_ms(messages, period=period)


def test_every_phase_of_a_run_comes_after_the_earlier_ones() -> None:
    timeline = Timeline()
    previous_last = None
    for fmt in (*DATED, "native"):
        messages = DEVICES + 250
        times = _phase(fmt, messages, timeline.take(backlog_span_ms(messages, fmt=fmt)))
        if previous_last is not None:
            assert min(times) > previous_last, fmt
        previous_last = max(times)
    # The storm's two readings (seq 0 and 1) fit its stretch too.
    start = timeline.take(STORM_SPAN_MS)
    assert start > previous_last
    assert timeline.take(0) == start + STORM_SPAN_MS + PHASE_GAP_MS


def test_the_same_phases_get_the_same_times_and_a_negative_span_is_refused() -> None:
    first, second = Timeline(), Timeline()
    spans = [100, 0, 5_000, 1]
    assert [first.take(s) for s in spans] == [second.take(s) for s in spans]
    with pytest.raises(ValueError, match="cannot span"):
        Timeline().take(-1)
