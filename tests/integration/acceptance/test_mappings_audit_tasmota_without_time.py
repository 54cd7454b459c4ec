"""Audit: not every Tasmota `tele/{device}/SENSOR` carries `Time`. A Tasmota Zigbee bridge
(ZbBridge, or any build with Zigbee) publishes each device's report there as
`{"ZbReceived":{"0x8F20":{...}}}`, with a time only under `SetOption144 1` and a valid clock
(arendst/Tasmota, xdrv_23_zigbee: "Add time if needed (and if time is valid)"); its LoRaWAN
bridge writes `LwReceived` the same way. The `tasmota` profile refused every such reading
(`MAPPING_BAD_TIMESTAMP`, absent at `$.Time`): a bridge's whole fleet was dead letters. It is
now dated as a payload without a time is (Zigbee2MQTT's): the receive time cut to
`receive_window_ms`, so a second report with the same values, later, is a reading of its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import aiomqtt
import asyncpg

from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

CONFIG: Final = """
[[ingest.mappings]]
name = "tasmota"
profile = "tasmota"
receive_window_ms = 1
"""
# Tasmota's Zigbee documentation: a switch's report, the defaults (no SetOption144).
REPORT: Final = (
    b'{"ZbReceived":{"0x8F20":{"Device":"0x8F20","Power":1,"Endpoint":1,"LinkQuality":66}}}'
)


async def test_a_tasmota_reading_without_time_is_stored_at_its_receive_time(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port

    async with running_daemon(make_config(dsn=db_dsn, mqtt_port=port, extra=CONFIG)) as daemon:

        def handled(count: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                read = metric(daemon, "gateway_telemetry_received_total")
                refused = metric(
                    daemon, "gateway_dead_letters_total", {"reason": "MAPPING_BAD_TIMESTAMP"}
                )
                return read + refused >= count

            return check

        async with aiomqtt.Client("127.0.0.1", port, identifier="zbbridge") as bridge:
            await bridge.publish("tele/zbbridge/SENSOR", REPORT, qos=1)
            await wait_until(handled(1), timeout=30, message="the first report handled")
            # The switch turned on again later: the same report, another reading.
            await bridge.publish("tele/zbbridge/SENSOR", REPORT, qos=1)
            await wait_until(handled(2), timeout=30, message="the second report handled")
    letters = await db.fetch("SELECT reason, detail FROM dead_letter")
    assert [dict(r) for r in letters] == [], "a Tasmota reading without Time refused"
    rows = await db.fetch(
        "SELECT ts, received_at, metrics FROM telemetry WHERE device_id = 'zbbridge' ORDER BY ts"
    )
    assert len(rows) == 2, "the second report taken for a redelivery of the first"
    assert rows[0]["metrics"] == rows[1]["metrics"]
    assert "ZbReceived.0x8F20.Power" in rows[0]["metrics"]
    for row in rows:
        assert abs((row["received_at"] - row["ts"]).total_seconds()) < 5
