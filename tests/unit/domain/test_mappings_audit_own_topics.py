"""Audit: a mapping's topic may not catch what the gateway publishes itself. The native topics
were checked (``{prefix}/devices/...``); the commands the gateway sends to mapped devices, on
the mappings' own ``command_topic``, were not: docs/devices.md's own mapping for Zigbee2MQTT
names with a `/` (``zigbee2mqtt/{room}/{device}``) beside the profile read every command sent
to a one-level device (``zigbee2mqtt/lamp/set``) back as telemetry of a device ``set``."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.domain.errors import ConfigError, ConfigErrors
from gateway.domain.mappings import MappedTelemetry

NOW_MS = 1_767_225_600_000

ROOMS = """
[[ingest.mappings]]
name = "z2m"
profile = "zigbee2mqtt"

[[ingest.mappings]]
name = "z2m-rooms"
profile = "zigbee2mqtt"
topic = "zigbee2mqtt/{room}/{device}"
device = "{device}"
presence_topic = ""
command_topic = "zigbee2mqtt/{room}/{device}/set"
"""


def _errors(toml: str) -> dict[str, str]:
    try:
        config = parse_config(toml)
        config.mappings()
    except ConfigErrors as exc:
        return {error.key_path: error.message for error in exc.errors}
    except ConfigError as exc:
        return {exc.key_path: exc.message}
    return {}


def test_a_mapping_topic_may_not_catch_the_commands_the_gateway_sends_to_mapped_devices() -> None:
    errors = _errors(ROOMS)
    if not errors:
        # What the configuration accepted makes of the gateway's own command to a device.
        mappings = parse_config(ROOMS).mappings()
        downlink = mappings.downlink(
            "z2m",
            {"device": "lamp"},
            device_id="lamp",
            command="set",
            command_id=7,
            params={"state": "ON"},
        )
        assert downlink is not None
        read = mappings.read(downlink.topic, downlink.payload, NOW_MS)
        assert not isinstance(read, MappedTelemetry), (
            f"the gateway's own command on {downlink.topic!r} was read back as telemetry: {read}"
        )
    message = errors["ingest.mappings[1].topic"]
    assert "would match every command the gateway sends" in message
    assert "zigbee2mqtt/{device}/set" in message
    assert "ingest.mappings[0]" in message


def test_a_mapping_may_not_catch_its_own_commands_nor_a_presence_topic_others() -> None:
    errors = _errors(
        """
[[ingest.mappings]]
name = "home"
topic = "home/{device}/{kind}"
device = "{device}"
flatten = "$"
command_topic = "home/{device}/set"

[[ingest.mappings]]
name = "tas"
profile = "tasmota"
presence_topic = "cmnd/{device}/{what}"
"""
    )
    assert "home/{device}/set" in errors["ingest.mappings[0].topic"]
    assert "cmnd/{device}/{command}" in errors["ingest.mappings[1].presence_topic"]


def test_the_profiles_side_by_side_catch_none_of_each_others_commands() -> None:
    errors = _errors(
        """
[[ingest.mappings]]
name = "tasmota"
profile = "tasmota"
[[ingest.mappings]]
name = "z2m"
profile = "zigbee2mqtt"
[[ingest.mappings]]
name = "shelly"
profile = "shelly-gen2"
[[ingest.mappings]]
name = "lora"
profile = "chirpstack-v4"
[[ingest.mappings]]
name = "boilers"
topic = "plant/{site}/boiler/{unit}/state"
device = "{site}-boiler-{unit}"
flatten = "$"
command_topic = "plant/{site}/boiler/{unit}/set"
"""
    )
    assert errors == {}
