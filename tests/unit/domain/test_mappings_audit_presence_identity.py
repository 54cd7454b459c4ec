"""Audit: a mapping's presence topic names its device "as `device` does" (docs/devices.md).
One whose wildcards differ from the telemetry topic's fell back to its own single wildcard,
bare, whatever the device template made of the telemetry's: with ``device = "plant1-{id}"``
the readings were device ``plant1-x`` and its Will went to a device ``x`` of its own (the
device's presence never changed, an inactivity rule on its Will never fired for it)."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.domain.errors import ConfigError, ConfigErrors
from gateway.domain.mappings import MappedPresence, MappedTelemetry

NOW_MS = 1_767_225_600_000


def _errors(toml: str) -> dict[str, str]:
    try:
        parse_config(toml).mappings()
    except ConfigErrors as exc:
        return {error.key_path: error.message for error in exc.errors}
    except ConfigError as exc:
        return {exc.key_path: exc.message}
    return {}


PLANT = """
[[ingest.mappings]]
name = "plant"
topic = "sensors/{id}/data"
device = "plant1-{id}"
flatten = "$"
presence_topic = "status/{node}"
"""


def test_a_presence_topic_that_cannot_name_the_device_as_device_does_is_refused() -> None:
    errors = _errors(PLANT)
    if not errors:
        mappings = parse_config(PLANT).mappings()
        reading = mappings.read("sensors/x/data", b'{"t": 1}', NOW_MS)
        will = mappings.read("status/x", b"offline", NOW_MS)
        assert isinstance(reading, MappedTelemetry)
        assert isinstance(will, MappedPresence)
        assert will.device_id == reading.device_id, (
            f"readings of {reading.device_id!r}, its Will of {will.device_id!r}"
        )
    assert "ingest.mappings[0].presence_topic" in errors, errors


def test_a_bare_wildcard_of_another_name_still_names_the_device() -> None:
    toml = PLANT.replace('device = "plant1-{id}"\n', "")
    assert _errors(toml) == {}
    mappings = parse_config(toml).mappings()
    reading = mappings.read("sensors/x/data", b'{"t": 1}', NOW_MS)
    will = mappings.read("status/x", b"offline", NOW_MS)
    assert isinstance(reading, MappedTelemetry)
    assert isinstance(will, MappedPresence)
    assert will.device_id == reading.device_id == "x"
