"""Audit: a command name is free text (the API takes any name that is not blank) and a
mapping's command_topic may hold it as a level (Tasmota's `cmnd/{device}/{command}`). A name
with a `/` rendered more levels than the mapping's topic has: `POWER/1` went out on
`cmnd/kitchen/POWER/1`, a topic the mapping does not describe, and the command sat `SENT` for
a day, where one the topic cannot hold (`+`, `#`, an empty level) fails at once
(`MAPPING_TEMPLATE`)."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.domain.mappings import DownlinkError

TASMOTA = '[[ingest.mappings]]\nname = "tasmota"\nprofile = "tasmota"\n'


def test_a_command_name_with_a_slash_is_no_level_of_the_topic() -> None:
    mappings = parse_config(TASMOTA).mappings()
    with pytest.raises(DownlinkError, match="more levels") as raised:
        mappings.downlink(
            "tasmota",
            {"device": "kitchen"},
            device_id="kitchen",
            command="POWER/1",
            command_id=3,
            params={"value": "ON"},
        )
    assert raised.value.code == "MAPPING_TEMPLATE"
    # The name alone, as ever.
    downlink = mappings.downlink(
        "tasmota",
        {"device": "kitchen"},
        device_id="kitchen",
        command="POWER1",
        command_id=4,
        params={"value": "ON"},
    )
    assert downlink is not None
    assert downlink.topic == "cmnd/kitchen/POWER1"
