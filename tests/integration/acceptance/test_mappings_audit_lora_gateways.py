"""Audit: a LoRaWAN device heard by two gateways, a near one and a far one, as LoRaWAN fleets
are (redundancy). ChirpStack v4 deduplicates the copies into one ``up`` event whose
``rxInfo`` lists every gateway's reception, in the order its deduplication set gave them back
(a Redis set, SMEMBERS: no order; chirpstack/src/uplink/mod.rs deduplicate_collect). The
``chirpstack-v4`` profile read ``rssi`` and ``snr`` from ``rxInfo[0]``: one uplink the near
gateway's figures, the next the far one's, at random. A weak-link rule (``rssi < -110``, the
device about to drop off the network) fired and cleared with that order while the device's
link never changed. The uplink is ChirpStack v4's documented ``up`` event
(tests/fixtures/mappings/), with a second ``rxInfo`` item of the same shape."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import aiomqtt
import asyncpg
import msgspec

from tests.support.daemon import make_config, running_daemon
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
key = "weak-link"
kind = "threshold"
metric = "rssi"
op = "<"
value = -110
severity = "WARNING"
"""


def _uplink(at: datetime, f_cnt: int, rx_info: list[dict[str, Any]]) -> bytes:
    return msgspec.json.encode({**UPLINK, "time": at.isoformat(), "fCnt": f_cnt, "rxInfo": rx_info})


async def test_the_link_of_a_device_heard_by_two_gateways_is_its_best_gateways(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    now = datetime.now(UTC).replace(microsecond=0)
    orders = ([NEAR, FAR], [FAR, NEAR], [NEAR, FAR], [FAR, NEAR])
    async with running_daemon(make_config(dsn=db_dsn, mqtt_port=port, extra=CONFIG)):
        async with aiomqtt.Client("127.0.0.1", port, identifier="chirpstack") as chirpstack:
            for f_cnt, rx_info in enumerate(orders):
                at = now - timedelta(seconds=60 * (len(orders) - f_cnt))
                await chirpstack.publish(TOPIC, _uplink(at, f_cnt, rx_info), qos=1)

        async def stored() -> bool:
            return int(await db.fetchval("SELECT count(*) FROM telemetry")) == len(orders)

        await wait_until(stored, timeout=30, message="the uplinks stored")
        links = await db.fetch(
            "SELECT (metrics->>'rssi')::float AS rssi, (metrics->>'snr')::float AS snr"
            " FROM telemetry ORDER BY ts"
        )
        assert [(r["rssi"], r["snr"]) for r in links] == [(-62, 9.5)] * len(orders), (
            "the link read from whichever gateway ChirpStack listed first"
        )
        assert int(await db.fetchval("SELECT count(*) FROM alarm")) == 0
