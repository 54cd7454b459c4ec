"""Audit: numbers written as strings (`"tempF": "104"`), as some firmwares send them, under a
metric the mapping scales (`scale`, `offset`: °F to °C). The value was stored as read, the
string "104", under the scaled metric's name: a °F figure named `temp_c`, and as text, which a
threshold rule (`temp_c > 30`) never compares, so a 40 °C room raised nothing. A number
written as a string is that number; a string that is no number stays as read."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.domain.mappings import MappedTelemetry

NOW_MS = 1_767_225_600_000

BOILER = """
[[ingest.mappings]]
name = "boiler"
topic = "plant/{unit}/state"
device = "{unit}"
[[ingest.mappings.metrics]]
path = "$.tempF"
name = "temp_c"
scale = 0.5555555555555556
offset = -17.77777777777778
[[ingest.mappings.metrics]]
path = "$.label"
"""


def _metrics(payload: bytes) -> dict[str, object]:
    read = parse_config(BOILER).mappings().read("plant/b1/state", payload, NOW_MS)
    assert isinstance(read, MappedTelemetry), read
    assert read.message.metrics is not None
    return dict(read.message.metrics)


@pytest.mark.parametrize("text", ["104", "104.0", " 104 ", "1.04e2", "+104"])
def test_a_number_written_as_a_string_is_scaled_as_that_number(text: str) -> None:
    metrics = _metrics(b'{"tempF": "' + text.encode() + b'", "label": "12"}')
    assert metrics["temp_c"] == pytest.approx(40.0)
    # Unscaled, a string stays the string it is.
    assert metrics["label"] == "12"


@pytest.mark.parametrize("text", ["hot", "NaN", "inf", "-Infinity", "0x20", "", "1_000"])
def test_a_string_that_is_no_number_stays_as_read(text: str) -> None:
    assert _metrics(b'{"tempF": "' + text.encode() + b'"}') == {"temp_c": text}
