"""Audit: zero-length payloads, MQTT's "clear the retained message" idiom.

Publishing a zero-length payload with retain=1 deletes the topic's retained message, and the
broker hands that empty message to every current subscriber. It is routine: Zigbee2MQTT clears
``zigbee2mqtt/<name>`` and its availability topic when a device is removed or renamed, an
operator cleans a stale status with ``mosquitto_pub -r -n -t iot/devices/<id>/status``, Tasmota
and Home Assistant tooling clear their retained topics. None of them is a reading of the device,
a statement of its presence or an error.

The gateway dead-lettered each (``MALFORMED`` on the native topics, ``MAPPING_MALFORMED``
"Input data was truncated" on a Zigbee2MQTT device's), noise on the page operators are told to
act on, once per device removed; and the empty telemetry counted the device heard.
"""

from __future__ import annotations

from typing import Final

import aiomqtt
import asyncpg
import msgspec
import pytest

from gateway.ingest import live_path
from gateway.ingest.decoder import EMPTY_KINDS
from gateway.ingest.replay import replay_one
from gateway.runtime.daemon import Daemon
from gateway.support.metrics import Metrics
from sim.publisher import publish_many
from storage import ingest as repo
from storage.ingest import DeadLetterRow
from tests.integration.services.test_ingest_refusals import (
    ONE_ROW_AT_A_TIME,
    _acked,
    _one_batch,
)
from tests.integration.services.test_ingest_refusals import _telemetry as _refused_telemetry
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

MAPPINGS: Final = (
    '[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n'
    '[[ingest.mappings]]\nname = "tasmota"\nprofile = "tasmota"\n'
    '[[ingest.mappings]]\nname = "shelly"\nprofile = "shelly-gen2"\n'
    '[[ingest.mappings]]\nname = "lora"\nprofile = "chirpstack-v4"\n'
)
SHELLY: Final = "shellyplus1-abc"
EUI: Final = "0011223344556677"
# Each presence topic and the word that says its device is online.
ONLINE: Final = {
    "iot/devices/dev-1/status": ("dev-1", b"online"),
    "tele/plug/LWT": ("plug", b"Online"),
    "zigbee2mqtt/lamp/availability": ("lamp", b'{"state":"online"}'),
    f"{SHELLY}/online": (SHELLY, b"true"),
}
# Every kind of topic the gateway reads, cleared (retained) or sent empty.
EMPTIES: Final = [
    ("iot/devices/dev-1/telemetry", False),
    ("iot/devices/dev-1/acks", False),
    ("tele/plug/SENSOR", True),
    ("zigbee2mqtt/lamp", True),
    (f"{SHELLY}/events/rpc", False),
    (f"application/1/device/{EUI}/event/up", False),
    *[(topic, True) for topic in ONLINE],
]


def _telemetry(seq: int) -> bytes:
    return msgspec.json.encode({"ts": 1_767_225_600_000 + seq, "seq": seq, "metrics": {"t": seq}})


def _empties(daemon: Daemon) -> dict[str, float]:
    return {k: metric(daemon, "gateway_empty_messages_total", {"kind": k}) for k in EMPTY_KINDS}


async def _devices(db: asyncpg.Connection) -> dict[str, tuple[object, ...]]:
    rows = await db.fetch("SELECT device_id, presence, presence_at, last_seen FROM device")
    return {r["device_id"]: (r["presence"], r["presence_at"], r["last_seen"]) for r in rows}


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_an_empty_message_is_no_reading_no_presence_and_no_dead_letter(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, protocol: str
) -> None:
    port = mosquitto.port
    config = make_config(dsn=db_dsn, mqtt_port=port, protocol=protocol, extra=MAPPINGS)
    async with (
        running_daemon(config) as daemon,
        aiomqtt.Client("127.0.0.1", port, identifier="field-tools") as tools,
    ):
        # Every device online (its birth, retained) and heard.
        for topic, (_, word) in ONLINE.items():
            await tools.publish(topic, word, qos=1, retain=True)
        await tools.publish("iot/devices/dev-1/telemetry", _telemetry(1), qos=1)

        async def online() -> bool:
            devices = await _devices(db)
            read = await db.fetchval("SELECT count(*) FROM telemetry")
            return read == 1 and all(
                devices.get(device, ("",))[0] == "online" for device, _ in ONLINE.values()
            )

        await wait_until(online, timeout=30, message="every device online")
        before = await _devices(db)

        # Each topic cleared or sent empty; QoS 1: publish returns at the PUBACK.
        for topic, retain in EMPTIES:
            await tools.publish(topic, b"", qos=1, retain=retain)
        # Then a reading of another device, stored once everything before it was.
        await tools.publish("iot/devices/dev-2/telemetry", _telemetry(2), qos=1)

        async def settled() -> bool:
            stored = await db.fetchval("SELECT count(*) FROM telemetry WHERE device_id = 'dev-2'")
            inflight = metric(daemon, "gateway_ingest_inflight")
            return stored == 1 and inflight == 0

        await wait_until(settled, timeout=30, message="the reading after the empty messages")
        letters = await db.fetch("SELECT topic, reason, detail FROM dead_letter ORDER BY id")
        assert [tuple(r) for r in letters] == [], "empty messages were dead-lettered"
        after = await _devices(db)
        for device in (d for d, _ in ONLINE.values()):
            assert after[device] == before[device], (
                f"{device}: a cleared message changed its presence or counted it heard"
            )
        assert await db.fetchval("SELECT count(*) FROM telemetry") == 2
        # Counted by the kind of topic, native or a mapping's.
        counted = {"telemetry": 5, "status": 4, "acks": 1, "sparkplug": 0, "other": 0}
        assert _empties(daemon) == counted
        assert metric(daemon, "gateway_presence_updates_total") == len(ONLINE)


async def test_an_empty_letter_of_an_earlier_release_replays_as_empty(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str
) -> None:
    """The letters an earlier release wrote for cleared messages are pending on the page: a
    replay resolves each (``empty``), and changes nothing of the device."""
    config = make_config(dsn=db_dsn, mqtt_port=1, extra=MAPPINGS)
    path = live_path.for_replay(config, Metrics())
    letters = [
        DeadLetterRow.whole("zigbee2mqtt/lamp", b"", "MAPPING_MALFORMED", "not JSON"),
        DeadLetterRow.whole("iot/devices/dev-1/status", b"", "INVALID", "got b''"),
    ]
    await repo.insert_dead_letters(db, letters, "gw-old")
    outcomes = []
    for letter_id in await db.fetchval("SELECT array_agg(id ORDER BY id) FROM dead_letter"):
        outcome = await replay_one(pool, path, letter_id)
        assert outcome is not None
        outcomes.append((outcome.outcome, outcome.succeeded))
    assert outcomes == [("empty", True), ("empty", True)]
    assert await db.fetchval("SELECT count(*) FROM device") == 0


async def test_two_nodes_sharing_the_devices_keep_every_presence_through_the_clearing(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """A `$share` group of two nodes (statuses reach every node: presence is not shared): a
    sweep clearing every device's retained status reaches both; neither takes it for a
    statement, and each counts it."""
    port = mosquitto.port
    shared = 'shared_group = "gw"'
    one = make_config(dsn=db_dsn, mqtt_port=port, node_id="node-1", mqtt_extra=shared)
    two = make_config(dsn=db_dsn, mqtt_port=port, node_id="node-2", mqtt_extra=shared)
    devices = [f"dev-{n}" for n in range(20)]
    async with (
        running_daemon(one) as first,
        running_daemon(two) as second,
        aiomqtt.Client("127.0.0.1", port, identifier="field-tools") as tools,
    ):
        for device in devices:
            await tools.publish(f"iot/devices/{device}/status", b"online", qos=1, retain=True)

        async def online() -> bool:
            count = await db.fetchval("SELECT count(*) FROM device WHERE presence = 'online'")
            return bool(count == len(devices))

        await wait_until(online, timeout=30, message="every device online")
        before = await _devices(db)
        for device in devices:
            await tools.publish(f"iot/devices/{device}/status", b"", qos=1, retain=True)

        def counted() -> bool:
            status = {"kind": "status"}
            return all(
                metric(daemon, "gateway_empty_messages_total", status) == len(devices)
                for daemon in (first, second)
            )

        await wait_until(counted, timeout=30, message="every clearing counted")
        assert await _devices(db) == before, "a cleared status changed a presence"
        assert await db.fetchval("SELECT count(*) FROM dead_letter") == 0


async def test_a_batch_dead_lettered_whole_leaves_its_empty_messages_out(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """A batch refused ``refused_batch_attempts`` times with no message refused alone is
    dead-lettered whole; an empty message in it is no message of it (it was a
    ``STORAGE_REJECTED`` letter, the refusal's detail quoted for zero bytes)."""
    await db.execute(ONE_ROW_AT_A_TIME)
    batch = [
        _refused_telemetry("dev-1", 1),
        ("iot/devices/dev-3/status", b""),
        _refused_telemetry("dev-2", 2),
    ]
    config = make_config(
        dsn=db_dsn,
        mqtt_port=mosquitto.port,
        ingest_extra=_one_batch(3, "refused_batch_attempts = 2"),
    )
    async with (
        running_daemon(config) as daemon,
        aiomqtt.Client("127.0.0.1", mosquitto.port) as pub,
    ):
        await publish_many(pub, batch, window=3)
        await wait_until(lambda: _acked(daemon) >= 3, timeout=30, message="dead-lettered")
        assert metric(daemon, "gateway_empty_messages_total", {"kind": "status"}) == 1
    letters = await db.fetch("SELECT topic, reason FROM dead_letter ORDER BY topic")
    assert [tuple(r) for r in letters] == [
        ("iot/devices/dev-1/telemetry", "STORAGE_REJECTED"),
        ("iot/devices/dev-2/telemetry", "STORAGE_REJECTED"),
    ]
