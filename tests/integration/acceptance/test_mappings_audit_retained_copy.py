"""Audit: a vendor device that publishes its readings retained (Zigbee2MQTT's per-device
``retain: true``, which node-red-contrib-zigbee2mqtt sets on every device it adds; Tasmota's
``SensorRetain 1``). The broker keeps the last reading and sends a copy of it, flagged
retained, to every new subscription: at each start of the gateway and each reconnection
(the node subscribes again every time). That copy is no report of the device.

The gateway read it as one. A Zigbee2MQTT reading carries no time, so the copy was dated when
it arrived: an SOS button pressed once (``{"action": "single"}``, the payload Zigbee2MQTT's
documentation prints for the WXKG01LM) was pressed again at each restart, a new reading and a
new occurrence for the event rules. A Tasmota reading carries its time, so the copy was a
duplicate, yet the device counted as heard at that moment: its ``last_seen`` moved to the
restart, past the Will ``Offline`` it had sent, so a dead plug no longer counted as offline.

The payloads are Zigbee2MQTT's and Tasmota's documented ones (tests/fixtures/mappings/).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

import aiomqtt
import asyncpg
import pytest

from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

FIXTURES: Final = Path(__file__).resolve().parents[2] / "fixtures" / "mappings"
PRESS: Final = (FIXTURES / "zigbee2mqtt-wxkg01lm-action.json").read_bytes()
SENSOR: Final = (FIXTURES / "tasmota-am2301-sensor.json").read_bytes()
MAPPINGS: Final = (
    '[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n'
    '[[ingest.mappings]]\nname = "tasmota"\nprofile = "tasmota"\n'
)
RULES: Final = """
[[rules]]
key = "sos"
kind = "event"
event = "action"
severity = "CRITICAL"
"""
BUTTON: Final = "zigbee2mqtt/sos_button"


async def _publish(port: int, topic: str, payload: bytes, *, retain: bool) -> None:
    async with aiomqtt.Client("127.0.0.1", port, identifier="vendor-devices") as devices:
        await devices.publish(topic, payload, qos=1, retain=retain)


async def _count(db: asyncpg.Connection, sql: str) -> int:
    return int(await db.fetchval(sql))


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_retained_vendor_reading_is_not_read_again_at_each_start(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, protocol: str
) -> None:
    port = mosquitto.port
    config = make_config(dsn=db_dsn, mqtt_port=port, protocol=protocol, extra=RULES + MAPPINGS)
    # Tasmota's Time, as a device set to UTC prints it.
    at = (datetime.now(UTC) - timedelta(seconds=60)).replace(microsecond=0, tzinfo=None)
    reading = SENSOR.replace(b"2019-01-01T00:00:00", at.isoformat().encode())
    presses = 'SELECT count(*) FROM telemetry WHERE events @> \'[{"value": "single"}]\''
    async with running_daemon(config):
        await _publish(port, BUTTON, PRESS, retain=True)
        await _publish(port, "tele/kitchen/SENSOR", reading, retain=True)
        # The plug dies: the broker publishes its Will, retained (Tasmota's LWT).
        await _publish(port, "tele/kitchen/LWT", b"Offline", retain=True)

        async def stored() -> bool:
            offline = await db.fetchval("SELECT presence FROM device WHERE device_id = 'kitchen'")
            return offline == "offline" and await _count(db, "SELECT count(*) FROM telemetry") == 2

        await wait_until(stored, timeout=30, message="the press, the reading, the Will")
    assert await _count(db, presses) == 1
    assert await _count(db, "SELECT count(*) FROM alarm WHERE rule_key = 'sos'") == 1
    last_seen = await db.fetchval("SELECT last_seen FROM device WHERE device_id = 'kitchen'")
    # While the gateway is away, another button is pressed: a report its session keeps (as
    # published: not a retained copy), read at the start, once.
    await _publish(port, "zigbee2mqtt/hall_button", PRESS, retain=True)

    # Restarted (an upgrade, a reload that reconnects): the broker sends the retained copies.
    async with running_daemon(config) as daemon:
        # After them, on the same topics (each device's messages are stored in order): a
        # second press of each button, and a payload the Tasmota mapping cannot read (a dead
        # letter).
        await _publish(port, BUTTON, b'{"action": "double"}', retain=False)
        await _publish(port, "zigbee2mqtt/hall_button", b'{"action": "double"}', retain=False)
        await _publish(port, "tele/kitchen/SENSOR", b'{"AM2301": ', retain=False)

        async def after_the_copies() -> bool:
            letters = await _count(db, "SELECT count(*) FROM dead_letter")
            doubles = 'SELECT count(*) FROM telemetry WHERE events @> \'[{"value": "double"}]\''
            return letters == 1 and await _count(db, doubles) == 2

        await wait_until(after_the_copies, timeout=30, message="the messages after the copies")
    assert (
        await db.fetchval("SELECT last_seen FROM device WHERE device_id = 'kitchen'") == last_seen
    ), "the dead plug counted as heard at the start (its retained reading read again)"
    assert await db.fetchval(
        "SELECT presence_at >= last_seen FROM device WHERE device_id = 'kitchen'"
    ), "the plug's Will Offline no longer counts for the inactivity rules"
    assert await _count(db, presses) == 2, "the button's one press was read again at the start"
    hall = presses + " AND device_id = 'hall_button'"
    assert await _count(db, hall) == 1, "the press made while the gateway was away"
    # One SOS alarm per press: none from the copies.
    assert await _count(db, "SELECT count(*) FROM alarm WHERE rule_key = 'sos'") == 4
    # Each copy counted: the sos button's, the hall button's, the plug's.
    assert metric(daemon, "gateway_mapped_retained_copies_total") == 3


async def test_a_retained_reading_is_read_by_a_node_without_a_session(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """The first start (or a session expired): the broker held nothing for the node, and the
    retained copy is all that is left of a reading published before it came. It is read."""
    port = mosquitto.port
    at = (datetime.now(UTC) - timedelta(seconds=60)).replace(microsecond=0, tzinfo=None)
    reading = SENSOR.replace(b"2019-01-01T00:00:00", at.isoformat().encode())
    await _publish(port, "tele/kitchen/SENSOR", reading, retain=True)
    config = make_config(dsn=db_dsn, mqtt_port=port, extra=MAPPINGS)
    async with running_daemon(config) as daemon:

        async def stored() -> bool:
            return await _count(db, "SELECT count(*) FROM telemetry") == 1

        await wait_until(stored, timeout=30, message="the retained reading read")
        assert metric(daemon, "gateway_mapped_retained_copies_total") == 0
    assert await db.fetchval("SELECT ts FROM telemetry") == at.replace(tzinfo=UTC)
