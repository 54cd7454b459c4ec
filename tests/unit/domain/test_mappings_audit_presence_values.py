"""Audit: a presence document whose value is a JSON boolean or number (`{"connected": true}`).
`online` and `offline` are TOML strings, and the value read at `presence_path` was compared as
it decoded (Python `True` against "true"): no configuration could read such a device's
presence, every birth and Will a dead letter `MAPPING_UNKNOWN_PRESENCE` ("presence 'True' is
neither 'true' nor 'false'"). A scalar is compared as its JSON text, as a bare payload is."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.domain.mappings import MappedPresence, Refusal

NOW_MS = 1_767_225_600_000


def _read(online: str, offline: str, payload: bytes) -> object:
    toml = f"""
[[ingest.mappings]]
name = "gw"
topic = "gw/{{device}}/data"
flatten = "$"
presence_topic = "gw/{{device}}/conn"
presence_path = "$.connected"
online = "{online}"
offline = "{offline}"
"""
    return parse_config(toml).mappings().read("gw/d1/conn", payload, NOW_MS)


@pytest.mark.parametrize(
    ("online", "offline", "payload", "value"),
    [
        ("true", "false", b'{"connected": true}', "online"),
        ("true", "false", b'{"connected": false}', "offline"),
        ("1", "0", b'{"connected": 1}', "online"),
        ("1", "0", b'{"connected": 0}', "offline"),
        ("up", "down", b'{"connected": "down"}', "offline"),
    ],
)
def test_a_json_scalar_presence_value_is_compared_as_its_json_text(
    online: str, offline: str, payload: bytes, value: str
) -> None:
    read = _read(online, offline, payload)
    assert isinstance(read, MappedPresence), read
    assert read.value == value


@pytest.mark.parametrize(
    "payload", [b'{"connected": "true"}', b'{"connected": null}', b'{"connected": [true]}']
)
def test_other_values_are_still_neither(payload: bytes) -> None:
    # A string "true" is the string, not the boolean's text: read as configured, it is
    # "true" too (a bare payload `true` is also read as that text).
    read = _read("true", "false", payload)
    if payload == b'{"connected": "true"}':
        assert isinstance(read, MappedPresence)
        return
    assert isinstance(read, Refusal)
    assert read.code == "MAPPING_UNKNOWN_PRESENCE"
