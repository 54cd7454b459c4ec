"""Audit: a LoRaWAN uplink sent twice by the radio. A device retransmits a frame (NbTrans > 1,
a confirmed uplink whose ACK was lost), or a gateway's copy reaches ChirpStack after its
deduplication window: ChirpStack v4 then sees the same frame (same DevAddr, FCnt, FPort and
FRMPayload) again. With frame-counter validation off for the device (`skip_fcnt_check`, the
setting ABP devices that restart their counter need), it publishes it again as an ``up`` event
of its own (chirpstack/src/uplink/data.rs handle_retransmission_reset): another
``deduplicationId``, another ``time`` (the new reception's), other ``rxInfo``. The content
hash of the event id differed, and the reading was stored twice: a ``for_samples = 2`` rule
counted one hot reading as two and raised an alarm. A device that restarts its counter (an
ABP device powered off and on, or an OTAA device rejoining with a new DevAddr) sends FCnt 0
again: a new reading, stored."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import aiomqtt
import asyncpg
import msgspec

from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

FIXTURES: Final = Path(__file__).resolve().parents[2] / "fixtures" / "mappings"
UPLINK: Final = msgspec.json.decode((FIXTURES / "chirpstack-v4-up.json").read_bytes())
DEV_EUI: Final = "0101010101010101"
TOPIC: Final = f"application/17c82e96-be03-4f38-aef3-f83d48582d97/device/{DEV_EUI}/event/up"
NEAR: Final = {**UPLINK["rxInfo"][0], "rssi": -62, "snr": 9.5}
FAR: Final = {**UPLINK["rxInfo"][0], "gatewayId": "0016c001f1500812", "rssi": -117, "snr": -13.2}
CONFIG: Final = """
[[ingest.mappings]]
name = "lora"
profile = "chirpstack-v4"

[[rules]]
key = "hot"
kind = "threshold"
metric = "temperature"
op = ">"
value = 30
for_samples = 2
severity = "WARNING"
"""


def _uplink(
    at: datetime,
    f_cnt: int,
    temperature: float,
    dedup: int,
    rx_info: list[dict[str, Any]],
    *,
    dev_addr: str = "00189440",
) -> bytes:
    return msgspec.json.encode(
        {
            **UPLINK,
            "deduplicationId": f"3ac7e3c4-0000-4b8d-9386-{dedup:012d}",
            "time": at.isoformat(),
            "devAddr": dev_addr,
            "fCnt": f_cnt,
            "data": f"t{temperature}",
            "object": {"temperature": temperature},
            "rxInfo": rx_info,
        }
    )


async def _published(port: int, uplinks: list[bytes]) -> None:
    async with aiomqtt.Client("127.0.0.1", port, identifier="chirpstack") as chirpstack:
        for uplink in uplinks:
            await chirpstack.publish(TOPIC, uplink, qos=1)


async def test_a_retransmitted_uplink_is_one_reading(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    now = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    uplinks = [
        _uplink(now, 7, 35.0, 1, [NEAR]),
        # The radio's second copy of FCnt 7, 2 s later, heard by the far gateway.
        _uplink(now + timedelta(seconds=2), 7, 35.0, 2, [FAR]),
        _uplink(now + timedelta(seconds=60), 8, 20.0, 3, [NEAR]),
    ]
    async with running_daemon(make_config(dsn=db_dsn, mqtt_port=port, extra=CONFIG)):
        await _published(port, uplinks)

        async def next_frame_stored() -> bool:
            return bool(
                await db.fetchval("SELECT count(*) FROM telemetry WHERE metrics->>'f_cnt' = '8'")
            )

        await wait_until(next_frame_stored, timeout=30, message="FCnt 8 stored")
        frames = await db.fetch(
            "SELECT (metrics->>'f_cnt')::int AS f_cnt FROM telemetry ORDER BY ts"
        )
        assert [r["f_cnt"] for r in frames] == [7, 8], "a retransmission stored as a reading"
        assert int(await db.fetchval("SELECT count(*) FROM alarm")) == 0


async def test_a_device_that_restarts_its_counter_is_read_again(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    now = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    uplinks = [
        _uplink(now, 0, 21.0, 11, [NEAR]),
        _uplink(now + timedelta(seconds=60), 1, 21.0, 12, [NEAR]),
        # Powered off and on (ABP: the same DevAddr), the counter back at 0, the same reading.
        _uplink(now + timedelta(seconds=90), 0, 21.0, 13, [NEAR]),
        # A rejoin (OTAA: a new DevAddr), the counter back at 0 again.
        _uplink(
            now + timedelta(seconds=150),
            0,
            21.0,
            14,
            [NEAR],
            dev_addr="01a2b3c4",
        ),
    ]
    async with running_daemon(make_config(dsn=db_dsn, mqtt_port=port, extra=CONFIG)):
        await _published(port, uplinks)

        async def stored() -> bool:
            return int(await db.fetchval("SELECT count(*) FROM telemetry")) >= len(uplinks)

        await wait_until(stored, timeout=30, message="every frame stored")
        frames = await db.fetch(
            "SELECT (metrics->>'f_cnt')::int AS f_cnt FROM telemetry ORDER BY ts"
        )
        assert [r["f_cnt"] for r in frames] == [0, 1, 0, 0]


async def test_nodes_of_a_shared_group_store_a_retransmitted_uplink_once(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """mosquitto hands a shared group's messages to its members in turn: each device's frame
    goes to one node, its retransmission, published next, to the other."""
    port = mosquitto.port
    now = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    devices = [f"01010101010101{n:02d}" for n in range(8)]
    messages: list[tuple[str, bytes]] = []
    for n, device in enumerate(devices):
        topic = TOPIC.replace(DEV_EUI, device)
        messages.append((topic, _uplink(now, 7, 35.0, 100 + 2 * n, [NEAR])))
        messages.append((topic, _uplink(now + timedelta(seconds=2), 7, 35.0, 101 + 2 * n, [FAR])))
    configs = [
        make_config(
            dsn=db_dsn,
            mqtt_port=port,
            node_id=f"node-{n}",
            extra=CONFIG,
            mqtt_extra='shared_group = "lora"',
        )
        for n in range(2)
    ]
    async with running_daemon(configs[0]) as one, running_daemon(configs[1]) as other:
        async with aiomqtt.Client("127.0.0.1", port, identifier="chirpstack") as chirpstack:
            for topic, uplink in messages:
                await chirpstack.publish(topic, uplink, qos=1)

        def read(name: str) -> float:
            return metric(one, name) + metric(other, name)

        async def every_message_stored_or_counted() -> bool:
            done = read("gateway_telemetry_stored_total") + read(
                "gateway_telemetry_duplicates_total"
            )
            return done >= len(messages)

        await wait_until(
            every_message_stored_or_counted, timeout=30, message="every uplink read by a node"
        )
        assert metric(one, "gateway_telemetry_received_total") > 0
        assert metric(other, "gateway_telemetry_received_total") > 0, "one node read all"
        per_device = await db.fetch("SELECT device_id, count(*) AS n FROM telemetry GROUP BY 1")
        assert {r["device_id"]: r["n"] for r in per_device} == dict.fromkeys(devices, 1)
        assert int(await db.fetchval("SELECT count(*) FROM alarm")) == 0
