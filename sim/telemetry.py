"""Deterministic telemetry payloads for simulated devices."""

from __future__ import annotations

import random
from collections.abc import Iterator

from protocol import Telemetry, Topics, encode_telemetry

EPOCH_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z: fixed, so runs are reproducible
# Between two phases' stretches of a Timeline.
PHASE_GAP_MS = 1_000


class Timeline:
    """Device time for the phases of one benchmark run, one stretch after another from
    ``start_ms``: every phase's samples are dated after all the earlier phases', as a fleet's
    samples come in time order. Telemetry's key leads with the time (migration 0036), so a
    phase then appends to what the earlier phases stored, as a fleet's ingest does, instead of
    writing between their rows (which split pages all over the index, and after the settle's
    checkpoint wrote a full-page image for each). The same phases in the same order get the
    same times: a run still publishes the same messages."""

    def __init__(self, start_ms: int = EPOCH_MS) -> None:
        self._next = start_ms

    def take(self, span_ms: int) -> int:
        """The first time of a phase whose samples span ``span_ms`` after it."""
        if span_ms < 0:
            raise ValueError(f"a phase cannot span {span_ms} ms")
        start = self._next
        self._next = start + span_ms + PHASE_GAP_MS
        return start


def device_ids(count: int, prefix: str = "sim") -> list[str]:
    return [f"{prefix}-{i:05d}" for i in range(count)]


def telemetry_stream(
    topics: Topics,
    devices: list[str],
    messages: int,
    *,
    seed: int = 1,
    start_seq: int = 0,
    epoch_ms: int = EPOCH_MS,
) -> Iterator[tuple[str, bytes]]:
    """``messages`` distinct telemetry messages spread round-robin over ``devices``, message
    ``n`` dated ``epoch_ms + n`` (the default, a fixed time: the same run, the same event ids).

    Each message is unique (device, seq), so every one must be stored exactly once.
    """
    rng = random.Random(seed)
    temps = {device: 20.0 + rng.random() * 5 for device in devices}
    for n in range(start_seq, start_seq + messages):
        device = devices[n % len(devices)]
        temps[device] += rng.uniform(-0.5, 0.5)
        message = Telemetry(
            ts=epoch_ms + n,
            seq=n,
            metrics={"temp": round(temps[device], 2), "battery": 100 - (n % 100)},
        )
        yield topics.telemetry(device), encode_telemetry(message)


def hysteresis_stream(
    topics: Topics,
    devices: list[str],
    messages: int,
    *,
    period: int,
    epoch_ms: int = EPOCH_MS,
) -> Iterator[tuple[str, bytes]]:
    """``messages`` samples round-robin over ``devices``, each device alternating ``period``
    samples of ``temp`` 95 and ``period`` of 70 (a ``temp > 80``, ``clear_value = 75`` rule
    fires on each run of 95 and clears on each run of 70), one second apart per device, from
    ``epoch_ms`` (over `hysteresis_span_ms`)."""
    count = len(devices)
    for n in range(messages):
        k = n // count
        message = Telemetry(
            ts=epoch_ms + k * 1000, seq=k, metrics={"temp": 95 if (k // period) % 2 == 0 else 70}
        )
        yield topics.telemetry(devices[n % count]), encode_telemetry(message)


def hysteresis_span_ms(devices: int, messages: int) -> int:
    """How long after its first time `hysteresis_stream`'s last sample is dated."""
    return (max(messages - 1, 0) // max(devices, 1)) * 1000


def hysteresis_alarms(devices: int, messages: int, *, period: int) -> tuple[int, int]:
    """What one node decides from ``hysteresis_stream``: (alarms raised, alarms cleared)."""
    raised = cleared = 0
    for d in range(devices):
        samples = messages // devices + (1 if d < messages % devices else 0)
        raised += (samples + 2 * period - 1) // (2 * period)  # runs of 95 begun
        cleared += (samples + period - 1) // (2 * period)  # runs of 70 begun
    return raised, cleared
