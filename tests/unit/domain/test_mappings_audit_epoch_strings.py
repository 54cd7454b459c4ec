"""Audit: epoch times written as strings (`"ts": "1767225600"`), as some firmwares send their
numbers. `epoch_s` and `epoch_ms` took JSON numbers only and no key reads a string as a
number: such a device could be read by no configuration, every reading a dead letter
`MAPPING_BAD_TIMESTAMP` ("not a number") that no replay fixes. A decimal number written as a
string is that number; any other string is still refused."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.domain.mappings import MappedTelemetry, Refusal

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
    payload = b'{"ts": ' + ts + b', "data": {"t": 21.5}}'
    return parse_config(toml).mappings().read("dev/d1/data", payload, NOW_MS)


@pytest.mark.parametrize(
    ("fmt", "ts", "ms"),
    [
        ("epoch_s", b'"1767225600"', NOW_MS),
        ("epoch_s", b'"1767225600.25"', NOW_MS + 250),
        ("epoch_ms", b'"1767225600123"', NOW_MS + 123),
        ("epoch_ms", b"1767225600123", NOW_MS + 123),
    ],
)
def test_an_epoch_time_written_as_a_string_is_that_time(fmt: str, ts: bytes, ms: int) -> None:
    read = _read(fmt, ts)
    assert isinstance(read, MappedTelemetry), read
    assert read.message.ts == ms
    # The same reading sent as a number is the same reading (one event id).
    same = _read(fmt, ts.strip(b'"'))
    assert isinstance(same, MappedTelemetry)
    assert same.event_id == read.event_id


@pytest.mark.parametrize("ts", [b'"soon"', b'"NaN"', b'"inf"', b'""', b'"0x10"', b'"-1"'])
def test_other_strings_are_still_refused(ts: bytes) -> None:
    read = _read("epoch_s", ts)
    assert isinstance(read, Refusal), read
    assert read.code == "MAPPING_BAD_TIMESTAMP"
