"""The decoder's mapped step (gateway/ingest/decoder.py): before the native topic parse, a
topic of [[ingest.mappings]] becomes a telemetry row, a presence update or a dead letter;
every other topic takes the native path as before."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Final

import pytest

from gateway.config import parse_config
from gateway.ingest import decoder as decoder_module
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.live_path import message_decoder

FIXTURES: Final = Path(__file__).resolve().parents[2] / "fixtures" / "mappings"
SENSOR: Final = (FIXTURES / "tasmota-am2301-sensor.json").read_bytes()


def _decoder(max_payload_bytes: int = 65536, dead_letter_max_bytes: int = 65536) -> MessageDecoder:
    config = parse_config(
        f"[mqtt]\nmax_payload_bytes = {max_payload_bytes}\n"
        f"[ingest]\ndead_letter_max_bytes = {dead_letter_max_bytes}\n"
        '[[ingest.mappings]]\nname = "tasmota"\nprofile = "tasmota"\n'
    )
    return message_decoder(config)


def test_mapped_and_native_messages_in_one_batch() -> None:
    decoder = _decoder()
    native = b'{"ts": 1767225600000, "metrics": {"t": 1.5}}'
    batch = decoder.classify(
        [
            Inbound("tele/kitchen/SENSOR", SENSOR, time.monotonic()),
            Inbound("iot/devices/dev-1/telemetry", native, time.monotonic()),
            Inbound("tele/kitchen/LWT", b"Online", time.monotonic()),
            Inbound("tele/kitchen/SENSOR", b"[]", time.monotonic()),
            Inbound("elsewhere/kitchen/SENSOR", SENSOR, time.monotonic()),
        ]
    )
    assert [row.device_id for row in batch.telemetry] == ["kitchen", "dev-1"]
    assert batch.telemetry[0].metrics_json == ('{"AM2301.Temperature":24.6,"AM2301.Humidity":58.2}')
    assert batch.presence == {"kitchen": "online"}
    assert batch.seen_devices == {"kitchen", "dev-1"}
    assert batch.mapped_devices == {"kitchen": ("tasmota", {"device": "kitchen"})}
    reasons = [(letter.topic, letter.reason) for letter in batch.dead_letters]
    # A topic neither a mapping nor the gateway reads: BAD_TOPIC, as before.
    assert reasons == [
        ("tele/kitchen/SENSOR", "MAPPING_MALFORMED"),
        ("elsewhere/kitchen/SENSOR", "BAD_TOPIC"),
    ]
    assert batch.dead_letters[0].payload == b"[]"


def test_an_oversized_mapped_payload_is_a_dead_letter_cut_down_on_arrival() -> None:
    decoder = _decoder(max_payload_bytes=64, dead_letter_max_bytes=16)
    big = SENSOR + b" " * 200
    kept, size, sha256 = decoder.admit(big)
    assert size == len(big)
    batch = decoder.classify([Inbound("tele/kitchen/SENSOR", kept, 0.0, size=size, sha256=sha256)])
    (letter,) = batch.dead_letters
    assert letter.reason == "OVERSIZED"
    assert letter.payload == big[:16]
    assert letter.payload_size == len(big)
    assert not batch.telemetry


def test_a_mapped_payload_over_the_limit_is_oversized_when_kept_whole_too() -> None:
    # Over [mqtt] max_payload_bytes but within what a dead letter keeps: kept whole on arrival,
    # and refused as on a native topic, never read (telemetry and presence alike).
    decoder = _decoder(max_payload_bytes=64)
    native = b'{"ts": 1767225600000, "metrics": {"t": 1.5}}' + b" " * 100
    sensor = SENSOR + b" " * 100
    lwt = b"Online" + b" " * 100
    for payload in (native, sensor, lwt):
        assert decoder.admit(payload) == (payload, None, None)
    batch = decoder.classify(
        [
            Inbound("iot/devices/dev-1/telemetry", native, time.monotonic()),
            Inbound("tele/kitchen/SENSOR", sensor, time.monotonic()),
            Inbound("tele/kitchen/LWT", lwt, time.monotonic()),
        ]
    )
    assert [letter.reason for letter in batch.dead_letters] == ["OVERSIZED"] * 3
    assert [letter.payload for letter in batch.dead_letters] == [native, sensor, lwt]
    assert batch.dead_letters[1].detail == f"payload is {len(sensor)} bytes, the limit is 64"
    assert not batch.telemetry
    assert not batch.presence


def test_a_redelivery_in_the_same_batch_is_one_event_id() -> None:
    decoder = _decoder()
    batch = decoder.classify(
        [
            Inbound("tele/kitchen/SENSOR", SENSOR, time.monotonic()),
            Inbound("tele/kitchen/SENSOR", SENSOR, time.monotonic() - 30),
        ]
    )
    first, second = batch.telemetry
    assert first.event_id == second.event_id
    assert first.ts_us == second.ts_us


def test_each_devices_presence_keeps_the_receipt_of_its_last_one_in_the_batch() -> None:
    """Native and mapped alike: the receipt of the presence the batch stores (its last), for
    ordering it against other nodes' (docs/rules-and-alarms.md); none for a message without a
    receive time (a replayed dead letter), even after one with a time."""
    batch = _decoder().classify(
        [
            Inbound("iot/devices/dev-1/status", b"offline", 10.0),
            Inbound("tele/kitchen/LWT", b"Offline", 10.5),
            Inbound("iot/devices/dev-1/status", b"online", 11.0),
            Inbound("tele/kitchen/LWT", b"Online", 11.5),
            Inbound("iot/devices/dev-2/status", b"online", 12.0),
            Inbound("iot/devices/dev-2/status", b"offline"),
        ]
    )
    assert batch.presence == {"dev-1": "online", "kitchen": "online", "dev-2": "offline"}
    assert batch.presence_received == {"dev-1": 11.0, "kitchen": 11.5}


def test_a_reading_with_no_time_of_its_own_waited_out_a_long_outage_is_dated_at_receipt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A zigbee2mqtt reading carries no time: it is dated when the node received it. One
    that waited in the node's queue while PostgreSQL was away for over an hour (the writer
    held, the queue full) used to be dated when it was decoded after the outage ("an age
    outside the bounds is not on this clock"): hours late, and the device's readings held
    together all dated within the same milliseconds. (The node's monotonic clock is moved on,
    as on a machine up for longer than this test's may be.)"""
    decoder = message_decoder(
        parse_config('[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n')
    )
    shifted = SimpleNamespace(monotonic=lambda: time.monotonic() + 10_000.0, time=time.time)
    monkeypatch.setattr(decoder_module, "time", shifted)
    now = shifted.monotonic()
    batch = decoder.classify(
        [
            Inbound("zigbee2mqtt/cellar", b'{"temperature": 4.5}', now - 3700.0),
            Inbound("zigbee2mqtt/cellar", b'{"temperature": 4.6}', now - 3640.0),
        ]
    )
    first, second = (row.ts_us / 1e6 for row in batch.telemetry)
    assert abs(first - (time.time() - 3700.0)) < 5.0
    assert second - first == pytest.approx(60.0, abs=0.01)
