"""Audit: epoch times in microseconds or nanoseconds (a clock read with `esp_timer`, Go's
`UnixNano`, InfluxDB-style exporters). Only seconds and milliseconds could be configured: as
`epoch_ms` such a time is centuries ahead (refused `MAPPING_BAD_TIMESTAMP`, out of range), so a
device sending one could be read by no configuration but the receive time, losing its own."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError
from gateway.domain.mappings import MappedTelemetry

NOW_MS = 1_767_225_600_000


def _read(fmt: str, ts: bytes) -> object:
    toml = f"""
[[ingest.mappings]]
name = "dev"
topic = "dev/{{device}}/data"
flatten = "$.data"
timestamp_path = "$.ts"
timestamp_format = "{fmt}"
"""
    try:
        mappings = parse_config(toml).mappings()
    except ConfigError as exc:
        raise AssertionError(f"timestamp_format {fmt!r} refused: {exc}") from None
    payload = b'{"ts": ' + ts + b', "data": {"t": 21.5}}'
    return mappings.read("dev/d1/data", payload, NOW_MS)


@pytest.mark.parametrize(
    ("fmt", "ts"),
    [
        ("epoch_us", b"1767225600123456"),
        ("epoch_us", b"1767225600123456.7"),
        ("epoch_us", b'"1767225600123999"'),
        ("epoch_ns", b"1767225600123456789"),
        ("epoch_ns", b'"1767225600123000000"'),
    ],
)
def test_micro_and_nanosecond_epochs_are_read_to_the_millisecond(fmt: str, ts: bytes) -> None:
    read = _read(fmt, ts)
    assert isinstance(read, MappedTelemetry), read
    assert read.message.ts == NOW_MS + 123
