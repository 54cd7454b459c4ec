"""``gateway-sim publish --format``: each vendor stream is read by the profile of its name
into one distinct reading per message (so a bench on it can count exactly-once), on the
devices it was published for."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.domain.mappings import MappedTelemetry
from sim.telemetry import device_ids
from sim.vendor import FORMATS, device_eui, vendor_stream


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "native"])
def test_every_message_is_one_distinct_reading_of_its_device(fmt: str) -> None:
    mappings = parse_config(f'[[ingest.mappings]]\nname = "m"\nprofile = "{fmt}"\n').mappings()
    devices = device_ids(7)
    expected = {device_eui(d) if fmt == "chirpstack-v4" else d for d in devices}
    ids: set[str] = set()
    seen: set[str] = set()
    count = 3000
    # All received within one receive window: only the payloads may tell them apart.
    for topic, payload in vendor_stream(fmt, devices, count, seed=3):
        read = mappings.read(topic, payload, 1_767_225_600_000)
        assert isinstance(read, MappedTelemetry), read
        assert read.message.metrics
        ids.add(read.event_id)
        seen.add(read.device_id)
    assert len(ids) == count
    assert seen == expected


def test_streams_are_reproducible() -> None:
    first = list(vendor_stream("tasmota", device_ids(3), 10, seed=5))
    assert first == list(vendor_stream("tasmota", device_ids(3), 10, seed=5))
    assert first != list(vendor_stream("tasmota", device_ids(3), 10, seed=6))
