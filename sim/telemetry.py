"""Deterministic telemetry payloads for simulated devices."""

from __future__ import annotations

import random
from collections.abc import Iterator

from protocol import Telemetry, Topics, encode_telemetry

EPOCH_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z: fixed, so runs are reproducible


def device_ids(count: int, prefix: str = "sim") -> list[str]:
    return [f"{prefix}-{i:05d}" for i in range(count)]


def telemetry_stream(
    topics: Topics,
    devices: list[str],
    messages: int,
    *,
    seed: int = 1,
    start_seq: int = 0,
) -> Iterator[tuple[str, bytes]]:
    """``messages`` distinct telemetry messages spread round-robin over ``devices``.

    Each message is unique (device, seq), so every one must be stored exactly once.
    """
    rng = random.Random(seed)
    temps = {device: 20.0 + rng.random() * 5 for device in devices}
    for n in range(start_seq, start_seq + messages):
        device = devices[n % len(devices)]
        temps[device] += rng.uniform(-0.5, 0.5)
        message = Telemetry(
            ts=EPOCH_MS + n,
            seq=n,
            metrics={"temp": round(temps[device], 2), "battery": 100 - (n % 100)},
        )
        yield topics.telemetry(device), encode_telemetry(message)
