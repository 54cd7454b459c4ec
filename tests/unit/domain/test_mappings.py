"""[[ingest.mappings]]: each built-in profile against its project's documented payloads
(tests/fixtures/mappings/SOURCES.md), a custom mapping using every key, the event ids of
redeliveries and of distinct readings, commands rendered for mapped devices, and
check-config's errors."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final
from zoneinfo import ZoneInfo

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError, ConfigErrors
from gateway.domain.mappings import (
    DownlinkError,
    MappedPresence,
    MappedTelemetry,
    Mappings,
    Refusal,
    compiled,
)

FIXTURES: Final = Path(__file__).resolve().parents[2] / "fixtures" / "mappings"
NOW_MS: Final = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def mappings(toml: str) -> Mappings:
    return parse_config(toml).mappings()


def profile(name: str) -> Mappings:
    return mappings(f'[[ingest.mappings]]\nname = "m"\nprofile = "{name}"\n')


def telemetry(result: object) -> MappedTelemetry:
    assert isinstance(result, MappedTelemetry), result
    return result


def test_tasmota_sensor_readings_become_metrics_named_by_their_nested_keys() -> None:
    read = telemetry(
        profile("tasmota").read(
            "tele/kitchen/SENSOR", fixture("tasmota-am2301-sensor.json"), NOW_MS
        )
    )
    assert read.device_id == "kitchen"
    assert read.message.metrics == {"AM2301.Temperature": 24.6, "AM2301.Humidity": 58.2}
    assert read.message.events is None
    # Tasmota's Time has no offset: read in the mapping's timezone, UTC by default.
    assert read.message.ts == 1_546_300_800_000  # 2019-01-01T00:00:00Z
    berlin = mappings(
        '[[ingest.mappings]]\nname = "t"\nprofile = "tasmota"\ntimezone = "Europe/Berlin"\n'
    ).read("tele/kitchen/SENSOR", fixture("tasmota-am2301-sensor.json"), NOW_MS)
    assert telemetry(berlin).message.ts == 1_546_300_800_000 - 3_600_000
    assert read.captures == {"device": "kitchen"}


def test_tasmota_lwt_is_presence() -> None:
    m = profile("tasmota")
    assert m.read("tele/kitchen/LWT", fixture("tasmota-lwt-online.txt"), NOW_MS) == (
        MappedPresence("m", "kitchen", "online", {"device": "kitchen"})
    )
    assert m.read("tele/kitchen/LWT", fixture("tasmota-lwt-offline.txt"), NOW_MS) == (
        MappedPresence("m", "kitchen", "offline", {"device": "kitchen"})
    )


def test_tasmota_redelivery_has_one_id_and_a_new_reading_another() -> None:
    """The id (and the stored time, the other half of the table's key) hang on the payload's
    own Time, not on when it arrived: a redelivery an hour later is the same reading; the
    next reading (another Time, same values) is not."""
    m = profile("tasmota")
    payload = fixture("tasmota-am2301-sensor.json")
    first = telemetry(m.read("tele/kitchen/SENSOR", payload, NOW_MS))
    again = telemetry(m.read("tele/kitchen/SENSOR", payload, NOW_MS + 3_600_000))
    later = payload.replace(b"2019-01-01T00:00:00", b"2019-01-01T00:05:00")
    next_reading = telemetry(m.read("tele/kitchen/SENSOR", later, NOW_MS + 300_000))
    assert first.event_id == again.event_id
    assert next_reading.event_id != first.event_id
    other_device = telemetry(m.read("tele/hall/SENSOR", payload, NOW_MS))
    assert other_device.event_id != first.event_id


def test_zigbee2mqtt_documented_payloads() -> None:
    m = profile("zigbee2mqtt")
    sensor = telemetry(
        m.read("zigbee2mqtt/0x00158d0001d8e1d2", fixture("zigbee2mqtt-wsdcgq01lm.json"), NOW_MS)
    )
    assert sensor.device_id == "0x00158d0001d8e1d2"
    assert sensor.message.metrics == {"temperature": 27.34, "humidity": 44.72}
    button = telemetry(
        m.read("zigbee2mqtt/hall switch", fixture("zigbee2mqtt-wxkg01lm-action.json"), NOW_MS)
    )
    # Friendly names may hold spaces: normalised (documented), the vendor's name kept for
    # its commands.
    assert button.device_id == "hall_switch"
    assert button.captures == {"device": "hall switch"}
    assert button.message.metrics is None
    assert button.message.events == [{"type": "action", "value": "single"}]
    bulb = telemetry(m.read("zigbee2mqtt/bulb", fixture("zigbee2mqtt-led1545g12.json"), NOW_MS))
    assert bulb.message.metrics == {"state": "ON", "brightness": 215, "color_temp": 325}
    assert m.read(
        "zigbee2mqtt/bulb/availability", fixture("zigbee2mqtt-availability-online.json"), NOW_MS
    ) == MappedPresence("m", "bulb", "online", {"device": "bulb"})
    # The legacy availability payload, a bare word.
    presence = m.read("zigbee2mqtt/bulb/availability", b"offline", NOW_MS)
    assert isinstance(presence, MappedPresence)
    assert presence.value == "offline"


def test_zigbee2mqtt_presses_are_apart_beyond_the_receive_window_and_one_within_it() -> None:
    m = profile("zigbee2mqtt")
    press = fixture("zigbee2mqtt-wxkg01lm-action.json")
    first = telemetry(m.read("zigbee2mqtt/sw", press, NOW_MS + 100))
    redelivered = telemetry(m.read("zigbee2mqtt/sw", press, NOW_MS + 900))
    second_press = telemetry(m.read("zigbee2mqtt/sw", press, NOW_MS + 1100))
    assert first.event_id == redelivered.event_id
    assert first.message.ts == redelivered.message.ts == NOW_MS  # the window's start
    assert second_press.event_id != first.event_id
    assert second_press.message.ts == NOW_MS + 1000


def test_shelly_gen2_notify_status() -> None:
    m = profile("shelly-gen2")
    topic = "shellypro4pm-f008d1d8b8b8/events/rpc"
    switch = telemetry(m.read(topic, fixture("shelly-gen2-notifystatus-switch.json"), NOW_MS))
    assert switch.device_id == "shellypro4pm-f008d1d8b8b8"
    assert switch.message.ts == 1_631_186_545_040  # params.ts, epoch seconds
    assert switch.message.metrics == {
        "switch:0.id": 0,
        "switch:0.output": True,
        "switch:0.source": "button",
    }
    cloud = telemetry(m.read(topic, fixture("shelly-gen2-notifystatus-cloud.json"), NOW_MS))
    assert cloud.message.metrics == {"cloud.connected": False}
    assert cloud.message.ts == 1_624_348_482_250
    assert m.read(
        "shellypro4pm-f008d1d8b8b8/online", fixture("shelly-gen2-online-false.txt"), NOW_MS
    ) == MappedPresence(
        "m", "shellypro4pm-f008d1d8b8b8", "offline", {"device": "shellypro4pm-f008d1d8b8b8"}
    )


def test_shelly_gen2_notify_event_becomes_events() -> None:
    """NotifyEvent's ``params.events`` (same Notifications page): each entry one event."""
    payload = (
        b'{"src":"shellyplus1-a8032abe54dc","dst":"user_1","method":"NotifyEvent","params":'
        b'{"ts":1631266595.43,"events":[{"component":"input:0","id":0,'
        b'"event":"single_push","ts":1631266595.43}]}}'
    )
    read = telemetry(
        profile("shelly-gen2").read("shellyplus1-a8032abe54dc/events/rpc", payload, NOW_MS)
    )
    assert read.message.metrics is None
    assert read.message.events == [
        {
            "type": "single_push",
            "value": {"component": "input:0", "id": 0, "event": "single_push", "ts": 1631266595.43},
        }
    ]


def test_chirpstack_v4_uplink() -> None:
    topic = "application/17c82e96-be03-4f38-aef3-f83d48582d97/device/0101010101010101/event/up"
    read = telemetry(profile("chirpstack-v4").read(topic, fixture("chirpstack-v4-up.json"), NOW_MS))
    assert read.device_id == "0101010101010101"
    # 2022-07-18T09:34:15.775023242+00:00, to the millisecond.
    assert read.message.ts == 1_658_136_855_775
    # No codec in the documented example: no `object`, the radio figures only (and fCnt 0
    # is left out of proto3 JSON, so absent).
    assert read.message.metrics == {"rssi": -36, "snr": 10.5, "f_port": 1, "dr": 1}
    with_object = fixture("chirpstack-v4-up.json").replace(
        b'"devAddr"', b'"object": {"temperature": 23.5, "battery": {"level": 87}}, "devAddr"'
    )
    decoded = telemetry(profile("chirpstack-v4").read(topic, with_object, NOW_MS))
    assert decoded.message.metrics is not None
    assert decoded.message.metrics["temperature"] == 23.5
    assert decoded.message.metrics["battery.level"] == 87


CUSTOM: Final = """
[[ingest.mappings]]
name = "boiler"
topic = "plant/{site}/boiler/{unit}/state"
device_path = "$.meta.serial"
timestamp_path = "$.meta.at"
timestamp_format = "iso8601"
[[ingest.mappings.metrics]]
path = "$.readings[0].tempF"
name = "temp_c"
scale = 0.5555555555555556
offset = -17.77777777777778
[[ingest.mappings.metrics]]
path = "$.readings[0].pressure"
name = "pressure"
scale = 0.001
[[ingest.mappings.metrics]]
path = '$["status.flags"].burner'
name = "burner"
[[ingest.mappings.events]]
path = "$.alerts"
type_path = "$.code"
"""


def test_a_custom_mapping_with_wildcards_paths_scaling_renames_iso_times_and_events() -> None:
    payload = (
        b'{"meta": {"serial": "B-77", "at": "2026-01-01T01:00:00+01:00"},'
        b' "readings": [{"tempF": 212, "pressure": 101325}],'
        b' "status.flags": {"burner": true},'
        b' "alerts": [{"code": "OVERHEAT", "level": 3}]}'
    )
    read = telemetry(mappings(CUSTOM).read("plant/north/boiler/2/state", payload, 0))
    assert read.device_id == "B-77"
    assert read.captures == {"site": "north", "unit": "2"}
    assert read.message.ts == NOW_MS  # +01:00 taken into account
    metrics = read.message.metrics
    assert metrics is not None
    assert metrics["temp_c"] == pytest.approx(100.0)
    assert metrics["pressure"] == pytest.approx(101.325)
    assert metrics["burner"] is True
    assert read.message.events == [{"type": "OVERHEAT", "value": {"code": "OVERHEAT", "level": 3}}]
    # Not our topic: None (the native parse follows).
    assert mappings(CUSTOM).read("plant/north/boiler/2", payload, 0) is None


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"not json", "MAPPING_MALFORMED"),
        (b"[1, 2]", "MAPPING_MALFORMED"),
        (
            b'{"meta": {"at": "2026-01-01T00:00:00Z"}, "readings": [{"tempF": 1}]}',
            "MAPPING_NO_DEVICE",
        ),
        (
            b'{"meta": {"serial": "a b", "at": "2026-01-01T00:00:00Z"}, '
            b'"readings": [{"tempF": 1}]}',
            "MAPPING_BAD_DEVICE_ID",
        ),
        (
            b'{"meta": {"serial": "x", "at": "2026-01-01T00:00:00"}, "readings": [{"tempF": 1}]}',
            "MAPPING_BAD_TIMESTAMP",
        ),
        (
            b'{"meta": {"serial": "x", "at": 5}, "readings": [{"tempF": 1}]}',
            "MAPPING_BAD_TIMESTAMP",
        ),
        (
            b'{"meta": {"serial": "x", "at": "2026-01-01T00:00:00Z"}, "readings": []}',
            "MAPPING_EMPTY",
        ),
        (
            b'{"meta": {"serial": "x", "at": "2026-01-01T00:00:00Z"}, '
            b'"alerts": [{"code": "no spaces"}]}',
            "MAPPING_INVALID",
        ),
        (
            b'{"meta": {"serial": "x", "at": "2026-01-01T00:00:00Z"}, '
            b'"readings": [{"tempF": 1e400}]}',
            "MAPPING_MALFORMED",
        ),
        # Nested a few thousand deep (10 kB): msgspec raises RecursionError, not a DecodeError.
        (b"[" * 5000 + b"]" * 5000, "MAPPING_MALFORMED"),
        # An integer outside int64 under a scaled metric: refused as unscaled, never scaled
        # (one too large for a float would raise OverflowError).
        (
            b'{"meta": {"serial": "x", "at": "2026-01-01T00:00:00Z"}, '
            b'"readings": [{"tempF": 1' + b"0" * 400 + b"}]}",
            "MAPPING_INVALID",
        ),
        (
            b'{"meta": {"serial": "x", "at": "2026-01-01T00:00:00Z"}, '
            b'"readings": [{"tempF": 9223372036854775808}]}',
            "MAPPING_INVALID",
        ),
    ],
)
def test_payloads_the_mapping_cannot_read_are_refused_with_its_reason(
    payload: bytes, code: str
) -> None:
    refusal = mappings(CUSTOM).read("plant/north/boiler/2/state", payload, 0)
    assert isinstance(refusal, Refusal)
    assert refusal.code == code
    assert refusal.detail.startswith("mapping 'boiler': ")


def test_presence_values_that_are_neither_are_refused() -> None:
    refusal = profile("tasmota").read("tele/kitchen/LWT", b"Sleeping", NOW_MS)
    assert isinstance(refusal, Refusal)
    assert refusal.code == "MAPPING_UNKNOWN_PRESENCE"
    # A presence document nested too deep to decode is no presence value either.
    nested = b"[" * 5000 + b"]" * 5000
    refusal = profile("zigbee2mqtt").read("zigbee2mqtt/door/availability", nested, NOW_MS)
    assert isinstance(refusal, Refusal)
    assert refusal.code == "MAPPING_UNKNOWN_PRESENCE"


def test_refused_device_ids_or_normalised_ones() -> None:
    refuse = profile("tasmota").read("tele/a b/SENSOR", fixture("tasmota-am2301-sensor.json"), 0)
    assert isinstance(refuse, Refusal)
    assert refuse.code == "MAPPING_BAD_DEVICE_ID"
    normalised = mappings(
        '[[ingest.mappings]]\nname = "t"\nprofile = "tasmota"\ndevice_ids = "normalise"\n'
    ).read("tele/a b/SENSOR", fixture("tasmota-am2301-sensor.json"), 0)
    assert telemetry(normalised).device_id == "a_b"
    # Where the broker maps `.`, a dotted id is refused (or normalised away).
    dotted = (
        parse_config(
            '[mqtt]\nbroker_family = "rabbitmq"\n'
            '[[ingest.mappings]]\nname = "t"\nprofile = "tasmota"\n'
        )
        .mappings()
        .read("tele/a.b/SENSOR", fixture("tasmota-am2301-sensor.json"), 0)
    )
    assert isinstance(dotted, Refusal)


def test_commands_render_on_each_profile_topic() -> None:
    def render(
        name: str, captures: dict[str, str], command: str, params: dict[str, Any]
    ) -> tuple[str, bytes]:
        downlink = profile(name).downlink(
            "m", captures, device_id="d", command=command, command_id=41, params=params
        )
        assert downlink is not None
        return downlink.topic, downlink.payload

    assert render("tasmota", {"device": "kitchen"}, "POWER", {"value": "ON"}) == (
        "cmnd/kitchen/POWER",
        b"ON",
    )
    assert render("zigbee2mqtt", {"device": "hall switch"}, "set", {"state": "OFF"}) == (
        "zigbee2mqtt/hall switch/set",
        b'{"state":"OFF"}',
    )
    assert render(
        "shelly-gen2", {"device": "shellyplus1-a8032abe54dc"}, "Switch.Set", {"id": 0, "on": True}
    ) == (
        "shellyplus1-a8032abe54dc/rpc",
        b'{"id":41,"src":"gateway","method":"Switch.Set","params":{"id":0,"on":true}}',
    )
    assert render(
        "chirpstack-v4",
        {"application_id": "app", "dev_eui": "0102030405060708"},
        "down",
        {"fPort": 10, "data": "qg=="},
    ) == (
        "application/app/device/0102030405060708/command/down",
        b'{"devEui":"0102030405060708","confirmed":false,"fPort":10,"data":"qg=="}',
    )
    with pytest.raises(DownlinkError) as missing:
        render("tasmota", {"device": "kitchen"}, "POWER", {})
    assert missing.value.code == "MAPPING_TEMPLATE"
    # A device seen through a mapping since removed: no mapped downlink.
    assert (
        profile("tasmota").downlink("gone", {}, device_id="d", command="c", command_id=1, params={})
        is None
    )


def _errors(toml: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as raised:
        parse_config(toml)
    error = raised.value
    errors = error.errors if isinstance(error, ConfigErrors) else [error]
    return [(e.key_path, e.message) for e in errors]


def test_check_config_names_each_mistake_by_its_key_path() -> None:
    errors = dict(
        _errors(
            """
[[ingest.mappings]]
profile = "tasmota"
[[ingest.mappings]]
name = "b"
profile = "lorawan"
[[ingest.mappings]]
name = "c"
topic = "a/+/b"
[[ingest.mappings]]
name = "d"
topic = "x/{dev}/y"
timestamp_format = "epoch_s"
flatten = "$"
[[ingest.mappings.metrics]]
path = "$.a..b"
[[ingest.mappings]]
name = "e"
topic = "x/{site}/{dev}"
flatten = "$"
command_topic = "cmd/{nope}"
command_payload = "{also_nope}"
"""
        )
    )
    assert errors["ingest.mappings[0].name"].startswith("required")
    assert "unknown profile 'lorawan'" in errors["ingest.mappings[1].profile"]
    assert "named wildcard" in errors["ingest.mappings[2].topic"]
    assert (
        errors["ingest.mappings[3].timestamp_path"] == "required with timestamp_format = 'epoch_s'"
    )
    assert "cannot read the path '$.a..b'" in errors["ingest.mappings[3].metrics[0].path"]
    assert errors["ingest.mappings[4].device"].startswith("required: which of {dev}, {site}")
    assert "{command}" in errors["ingest.mappings[4].command_topic"]
    assert "{also_nope}" in errors["ingest.mappings[4].command_payload"]


def test_a_mapping_may_not_take_the_gateways_own_topics() -> None:
    errors = _errors(
        '[[ingest.mappings]]\nname = "n"\ntopic = "iot/devices/{device}/telemetry"\nflatten = "$"\n'
    )
    assert errors[0][0] == "ingest.mappings[0].topic"
    assert "would match the gateway's own topics" in errors[0][1]


def test_mapping_names_are_unique() -> None:
    errors = _errors(
        '[[ingest.mappings]]\nname = "t"\nprofile = "tasmota"\n'
        '[[ingest.mappings]]\nname = "t"\nprofile = "shelly-gen2"\n'
    )
    assert errors == [("ingest.mappings[1].name", "'t' is taken already by ingest.mappings[0]")]


def test_every_profile_with_its_defaults_subscribes_telemetry_shared_and_presence_direct() -> None:
    m = mappings(
        "".join(
            f'[[ingest.mappings]]\nname = "p{n}"\nprofile = "{name}"\n'
            for n, name in enumerate(("tasmota", "zigbee2mqtt", "shelly-gen2", "chirpstack-v4"))
        )
    )
    assert m.filters() == (
        ["tele/+/SENSOR", "zigbee2mqtt/+", "+/events/rpc", "application/+/device/+/event/up"],
        ["tele/+/LWT", "zigbee2mqtt/+/availability", "+/online"],
    )


def test_a_topic_without_wildcards_names_its_device_from_the_payload() -> None:
    m = mappings(
        '[[ingest.mappings]]\nname = "gw"\ntopic = "lora/uplink"\n'
        'device_path = "$.dev"\nflatten = "$.data"\n'
    )
    read = telemetry(m.read("lora/uplink", b'{"dev": 42, "data": {"t": 1}}', NOW_MS))
    assert (read.device_id, read.message.metrics) == ("42", {"t": 1})
    errors = _errors('[[ingest.mappings]]\nname = "gw"\ntopic = "lora/uplink"\nflatten = "$"\n')
    assert errors == [
        (
            "ingest.mappings[0].device_path",
            "required: the topic has no wildcard to name the device by",
        )
    ]


def test_flattened_values_telemetry_cannot_carry_are_left_out() -> None:
    payload = b'{"Time": "2026-01-01T00:00:00", "note": "%s", "big": %d, "ok": 1}' % (
        b"x" * 2000,
        2**70,
    )
    read = telemetry(profile("tasmota").read("tele/a/SENSOR", payload, NOW_MS))
    assert read.message.metrics == {"ok": 1}


def _reference_ms(text: str, zone: str) -> int:
    """A naive time read in ``zone`` the long way: the zone's own offset at that wall time."""
    at = datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone))
    return (at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)


@pytest.mark.parametrize("zone", ["UTC", "Etc/UTC", "Zulu", "Europe/Berlin", "America/New_York"])
@pytest.mark.parametrize(
    "text",
    [
        "2026-01-01T00:00:00",
        "2026-03-29T01:59:59.999999",  # an hour before Berlin's clocks go forward
        "2026-03-29T03:00:00.000500",
        "2026-10-25T02:30:00",  # Berlin's hour that happens twice
        "2026-11-01T01:30:00.123",  # New York's
        "1970-01-01T05:00:00",
        "9999-12-31T23:59:59.999",
    ],
)
def test_naive_times_are_read_in_the_mapping_s_zone(text: str, zone: str) -> None:
    """Zones that are UTC always are read without the zone object (a third of the time);
    every zone answers as the zone's own offset does, to the millisecond (floored)."""
    payload = b'{"Time": "%s", "t": 1}' % text.encode()
    read = mappings(
        f'[[ingest.mappings]]\nname = "t"\nprofile = "tasmota"\ntimezone = "{zone}"\n'
    ).read("tele/a/SENSOR", payload, NOW_MS)
    expected = _reference_ms(text, zone)
    if 0 <= expected <= 253_370_764_799_999:
        assert telemetry(read).message.ts == expected
    else:
        assert isinstance(read, Refusal), read
        assert read.code == "MAPPING_BAD_TIMESTAMP"


def test_flattened_names_held_or_not_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The names of flattened leaves are held per mapping, FLAT_NAMES_HELD at most (emptied
    when full); held or made again, they read the same."""
    monkeypatch.setattr(compiled, "FLAT_NAMES_HELD", 3)
    m = profile("tasmota")
    for n in range(6):
        payload = b'{"Time": "2026-01-01T00:00:0%d", "S%d": {"a b": %d, "c": {"d": 1}}}' % (
            n,
            n % 4,
            n,
        )
        read = telemetry(m.read("tele/a/SENSOR", payload, NOW_MS))
        assert read.message.metrics == {f"S{n % 4}.a_b": n, f"S{n % 4}.c.d": 1}
    assert 0 < len(m.mappings[0]._flat_names) <= 3


def test_topics_held_or_not_read_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a topic matched is held per `Mappings`, a refused device id included, TOPICS_HELD
    at most (emptied when full); held or matched again, it reads the same. Each reading's
    wildcards are its own."""
    monkeypatch.setattr(compiled, "TOPICS_HELD", 2)
    m = profile("tasmota")
    sensor = fixture("tasmota-am2301-sensor.json")
    for _ in range(2):
        for device in ("a", "b", "c", "d"):
            read = telemetry(m.read(f"tele/{device}/SENSOR", sensor, NOW_MS))
            assert (read.device_id, read.captures) == (device, {"device": device})
            read.captures["device"] = "changed"  # never seen by the next reading
        refused = m.read("tele/a b/SENSOR", sensor, NOW_MS)
        assert isinstance(refused, Refusal)
        assert refused.code == "MAPPING_BAD_DEVICE_ID"
        assert m.order_key("tele/a b/SENSOR") == (True, "")
        assert m.order_key("tele/e/SENSOR") == (True, "e")
        assert m.read("elsewhere/e", sensor, NOW_MS) is None
        assert m.read("tele/e/LWT", b"Online", NOW_MS) == MappedPresence(
            "m", "e", "online", {"device": "e"}
        )
    assert 0 < len(m._topics) <= 2


def _utc_ms(text: str) -> int:
    return (datetime.fromisoformat(text) - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(
        milliseconds=1
    )


def test_the_repeated_hour_s_second_pass_is_dated_in_the_second_pass() -> None:
    """Berlin, 2026-10-25: the clocks go from 03:00 CEST back to 02:00 CET at 01:00 UTC, so a
    Tasmota device (local time, no offset) shows 02:00-02:59 twice. Sent live, each pass's
    02:30:00 is its own instant: 00:30 UTC (CEST), then 01:30 UTC (CET)."""
    m = mappings(
        '[[ingest.mappings]]\nname = "t"\nprofile = "tasmota"\ntimezone = "Europe/Berlin"\n'
    )
    payload = b'{"Time": "2026-10-25T02:30:00", "AM2301": {"Temperature": 21.5}}'
    first = telemetry(m.read("tele/a/SENSOR", payload, _utc_ms("2026-10-25T00:30:02+00:00")))
    second = telemetry(m.read("tele/a/SENSOR", payload, _utc_ms("2026-10-25T01:30:02+00:00")))
    assert first.message.ts == _utc_ms("2026-10-25T00:30:00+00:00")
    # It used to be 00:30 UTC again, the first pass's reading's event id: a duplicate, lost.
    assert second.message.ts == _utc_ms("2026-10-25T01:30:00+00:00")
    assert second.event_id != first.event_id
    # A redelivery of the first pass's reading is the same reading while it comes within the
    # half hour; the instant nearer its receipt decides.
    again = telemetry(m.read("tele/a/SENSOR", payload, _utc_ms("2026-10-25T00:59:00+00:00")))
    assert again.event_id == first.event_id


def test_the_hour_the_clocks_skip_is_read_with_the_offset_of_its_receipt() -> None:
    """Berlin, 2026-03-29: 02:00 CET becomes 03:00 CEST at 01:00 UTC; a clock that does not
    change shows 02:30 at 01:30 UTC (still +01:00 for it): read with the offset nearer its
    receipt, not an hour off (and one already an hour ahead, at 00:30 UTC, with the offset
    after the change)."""
    m = mappings(
        '[[ingest.mappings]]\nname = "t"\nprofile = "tasmota"\ntimezone = "Europe/Berlin"\n'
    )
    payload = b'{"Time": "2026-03-29T02:30:00", "AM2301": {"Temperature": 21.5}}'
    late = telemetry(m.read("tele/a/SENSOR", payload, _utc_ms("2026-03-29T01:30:02+00:00")))
    assert late.message.ts == _utc_ms("2026-03-29T01:30:00+00:00")
    early = telemetry(m.read("tele/a/SENSOR", payload, _utc_ms("2026-03-29T00:30:02+00:00")))
    assert early.message.ts == _utc_ms("2026-03-29T00:30:00+00:00")
