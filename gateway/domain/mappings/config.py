"""``[[ingest.mappings]]`` as operators write it, and the built-in profiles.

Every key but ``name`` may be left out: it is then the named ``profile``'s, or the default
below. ``None`` means "not given" (TOML has no null), so an empty string given explicitly
turns a profile's key off (``presence_topic = ""``: no presence for this mapping).
"""

from __future__ import annotations

from typing import Final

import msgspec


class MetricMapConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[ingest.mappings.metrics]]``: the value at ``path`` as metric ``name`` (default:
    the path's keys joined with ``.``), times ``scale`` plus ``offset`` when it is a number."""

    path: str
    name: str = ""
    scale: float = 1.0
    offset: float = 0.0


class EventMapConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[ingest.mappings.events]]``: the value at ``path`` (each item, for an array)
    becomes an event ``{"type": ..., "value": item}``; its type is ``type``, or the value at
    ``type_path`` inside the item, or else the item itself (a string)."""

    path: str
    type: str = ""
    type_path: str = ""


class MappingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str = ""
    profile: str = ""
    topic: str | None = None
    device: str | None = None
    device_path: str | None = None
    device_ids: str | None = None  # "refuse" | "normalise"
    # Where the time is: a path, or paths tried in order (the first that holds a value).
    # A `[*]` step reads every item's: the middle one of the times found.
    timestamp_path: str | list[str] | None = None
    # "iso8601" | "epoch_s" | "epoch_ms" | "epoch_us" | "epoch_ns" | "tasmota" | "receive"
    timestamp_format: str | None = None
    timezone: str | None = None  # IANA name: the zone of ISO times that carry no offset
    receive_window_ms: int | None = None
    flatten: str | None = None
    exclude: list[str] | None = None
    metrics: list[MetricMapConfig] | None = None
    events: list[EventMapConfig] | None = None
    presence_topic: str | None = None
    presence_path: str | None = None
    online: str | None = None
    offline: str | None = None
    command_topic: str | None = None
    command_payload: str | None = None
    # Where a radio frame's identity is: a reading whose values there are the device's last
    # reading's, within RETRANSMISSION_WINDOW_S, is that frame sent again (not stored again).
    frame_paths: list[str] | None = None


# What a key is when neither the mapping nor its profile gives it.
DEFAULTS: Final = MappingConfig(
    topic="",
    device="",
    device_path="",
    device_ids="refuse",
    timestamp_path="",
    timestamp_format="",
    timezone="",
    receive_window_ms=1000,
    flatten="",
    exclude=[],
    metrics=[],
    events=[],
    presence_topic="",
    presence_path="",
    online="online",
    offline="offline",
    command_topic="",
    command_payload="{params}",
    frame_paths=[],
)

# The built-in profiles: each project's default topics and payloads (docs/devices.md says
# where each comes from; tests/fixtures/mappings/ holds the payloads of their documentation).
PROFILES: Final[dict[str, MappingConfig]] = {
    # https://tasmota.github.io/docs/MQTT/ : tele/%topic%/SENSOR, tele/%topic%/LWT,
    # cmnd/%topic%/<command>. `Time` is the device's local time without an offset: read in
    # `timezone` (UTC unless the mapping names the devices' zone). Its `Time` command sets
    # the format: `Time 2` adds `Epoch` (UTC seconds: the instant, whatever the zone),
    # `Time 3` writes the epoch in `Time` itself.
    "tasmota": MappingConfig(
        topic="tele/{device}/SENSOR",
        device="{device}",
        timestamp_path=["$.Epoch", "$.Time"],
        timestamp_format="tasmota",
        timezone="UTC",
        flatten="$",
        exclude=["Time", "Epoch", "TempUnit", "PressureUnit", "SpeedUnit"],
        presence_topic="tele/{device}/LWT",
        online="Online",
        offline="Offline",
        command_topic="cmnd/{device}/{command}",
        command_payload="{params.value}",
    ),
    # https://www.zigbee2mqtt.io/guide/usage/mqtt_topics_and_message_structure.html
    "zigbee2mqtt": MappingConfig(
        topic="zigbee2mqtt/{device}",
        device="{device}",
        device_ids="normalise",
        flatten="$",
        exclude=["action", "last_seen"],
        events=[EventMapConfig(path="$.action", type="action")],
        presence_topic="zigbee2mqtt/{device}/availability",
        presence_path="$.state",
        online="online",
        offline="offline",
        command_topic="zigbee2mqtt/{device}/set",
        command_payload="{params}",
    ),
    # https://shelly-api-docs.shelly.cloud/gen2/General/Notifications : NotifyStatus and
    # NotifyEvent frames on <id>/events/rpc, `true`/`false` on <id>/online, RPC on <id>/rpc.
    "shelly-gen2": MappingConfig(
        topic="{device}/events/rpc",
        device="{device}",
        timestamp_path="$.params.ts",
        timestamp_format="epoch_s",
        flatten="$.params",
        exclude=["ts"],
        events=[EventMapConfig(path="$.params.events", type_path="$.event")],
        presence_topic="{device}/online",
        online="true",
        offline="false",
        command_topic="{device}/rpc",
        command_payload=(
            '{"id":{command_id},"src":"gateway","method":"{command}","params":{params}}'
        ),
    ),
    # https://www.chirpstack.io/docs/chirpstack/integrations/mqtt.html and events.html
    "chirpstack-v4": MappingConfig(
        topic="application/{application_id}/device/{dev_eui}/event/up",
        device="{dev_eui}",
        # When ChirpStack received each gateway's copy (`nsTime`: its own clock for every
        # gateway, set by ChirpStack v4 on each reception), the middle one; else `time`, which
        # is the first gateway's own clock in no order (rxInfo is a set): a gateway whose
        # clock is an hour off dated every other uplink an hour off.
        timestamp_path=["$.rxInfo[*].nsTime", "$.time"],
        timestamp_format="iso8601",
        flatten="$.object",
        metrics=[
            # Every gateway that heard the uplink, in no order (ChirpStack's deduplication
            # set): the best one's figures, not whichever it listed first.
            MetricMapConfig(path="$.rxInfo[*].rssi", name="rssi"),
            MetricMapConfig(path="$.rxInfo[*].snr", name="snr"),
            MetricMapConfig(path="$.fCnt", name="f_cnt"),
            MetricMapConfig(path="$.fPort", name="f_port"),
            MetricMapConfig(path="$.dr", name="dr"),
        ],
        # One LoRaWAN frame: sent again by the radio (NbTrans, a confirmed uplink's retry) or
        # heard by a gateway after the deduplication window, ChirpStack publishes it again
        # (with frame-counter validation off) under another deduplicationId, time and rxInfo.
        frame_paths=["$.devAddr", "$.fCnt", "$.fPort", "$.data"],
        command_topic="application/{application_id}/device/{dev_eui}/command/down",
        command_payload=(
            '{"devEui":"{dev_eui}","confirmed":false,"fPort":{params.fPort},"data":"{params.data}"}'
        ),
    ),
}

_KEYS: Final = tuple(field for field in MappingConfig.__struct_fields__ if field != "name")


def resolve(config: MappingConfig) -> MappingConfig:
    """``config`` with every key it leaves out taken from its profile, then the defaults.
    An unknown profile resolves against the defaults alone (``compile`` reports it)."""
    profile = PROFILES.get(config.profile)
    values: dict[str, object] = {}
    for key in _KEYS:
        value = getattr(config, key)
        if value is None and profile is not None:
            value = getattr(profile, key)
        if value is None:
            value = getattr(DEFAULTS, key)
        values[key] = value
    return msgspec.structs.replace(config, **values)
