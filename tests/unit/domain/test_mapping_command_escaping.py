"""A mapped device's command rendered into a JSON payload template keeps the template's shape,
whatever the values hold: a string put inside one of the template's JSON strings is escaped
there, and one put where the template has a JSON value is written as a JSON string (a number or
true/false/null written as text still goes as itself, as documented). Before, a string went in
as itself everywhere: a display text with a quote made a payload the device could not read (the
command then timed out), and one written to do so added fields the template never allowed
(`"reboot": true` beside the display text), a command name likewise in the Shelly profile's
`method`. A plain-text template (Tasmota's `{params.value}`) is unchanged."""

from __future__ import annotations

import json
from typing import Any

from gateway.domain.mappings import Mappings
from tests.unit.domain.test_mappings import mappings, profile

SIGN = """
[[ingest.mappings]]
name = "m"
topic = "signs/{device}/state"
command_topic = "signs/{device}/cmd"
flatten = "$"
command_payload = '{"display": "{params.text}", "level": {params.level}, "by": "{command}"}'
"""


def _payload(
    maps: Mappings, params: dict[str, Any], command: str = "show", device: str = "s1"
) -> bytes:
    downlink = maps.downlink(
        "m", {"device": device}, device_id=device, command=command, command_id=7, params=params
    )
    assert downlink is not None
    return downlink.payload


def test_a_string_inside_a_json_string_of_the_template_is_escaped_there() -> None:
    text = 'he said "hi", "reboot": true, "x": "'
    payload = _payload(mappings(SIGN), {"text": text, "level": 3})
    assert json.loads(payload) == {"display": text, "level": 3, "by": "show"}


def test_a_string_where_the_template_has_a_json_value_is_a_json_string() -> None:
    sneaky = '1, "reboot": true'
    assert json.loads(_payload(mappings(SIGN), {"text": "t", "level": sneaky})) == {
        "display": "t",
        "level": sneaky,
        "by": "show",
    }
    # A number, true, false or null written as text goes as itself, as documented.
    for literal, value in (("5", 5), ("2.5", 2.5), ("true", True), ("null", None)):
        payload = _payload(mappings(SIGN), {"text": "t", "level": literal})
        assert json.loads(payload)["level"] == value, literal


def test_a_command_name_with_a_quote_stays_in_the_shelly_method() -> None:
    name = 'Switch.Set","params":{"id":0,"on":false},"x":"'
    downlink = profile("shelly-gen2").downlink(
        "m", {"device": "shellyplus1-a8"}, device_id="d", command=name, command_id=41,
        params={"id": 0, "on": True},
    )  # fmt: skip
    assert downlink is not None
    assert json.loads(downlink.payload) == {
        "id": 41,
        "src": "gateway",
        "method": name,
        "params": {"id": 0, "on": True},
    }


def test_a_plain_text_template_takes_the_string_as_it_is() -> None:
    downlink = profile("tasmota").downlink(
        "m", {"device": "kitchen"}, device_id="d", command="POWER", command_id=1,
        params={"value": 'ON "now"'},
    )  # fmt: skip
    assert downlink is not None
    assert downlink.payload == b'ON "now"'
