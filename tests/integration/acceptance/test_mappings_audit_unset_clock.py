"""Audit: a Tasmota device that never reached an NTP server (an IoT network without internet)
dates its readings by its uptime: ``"Time": "1970-01-01T00:05:00"`` five minutes after each
start (arendst/Tasmota issues 2571, 4152, 4243: "Time set to 1970"). Its clock starts again at
every power cycle, so the first reading of a new start can carry the same time and values as
the reading of the start before at the same uptime (a switch that stayed OFF): docs/devices.md
says the next reading has another time, hence another id, but it had the same id and time, and
was taken for a redelivery of the old one and not stored."""

from __future__ import annotations

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
READING: Final = b'{"Time":"1970-01-01T00:05:00","Switch1":"OFF","ANALOG":{"A0":512}}'


async def test_a_reading_of_a_new_start_of_a_clock_never_set_is_stored(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    async with running_daemon(make_config(dsn=db_dsn, mqtt_port=port, extra=CONFIG)) as daemon:

        def read() -> float:
            return metric(daemon, "gateway_telemetry_received_total")

        async with aiomqtt.Client("127.0.0.1", port, identifier="tasmota") as plug:
            await plug.publish("tele/plug-1/SENSOR", READING, qos=1)

            async def first_read() -> bool:
                return read() >= 1

            await wait_until(first_read, timeout=30, message="the first start's reading read")
            # Powered off and on: five minutes after the new start, the same uptime and value.
            await plug.publish("tele/plug-1/SENSOR", READING, qos=1)

            async def second_read() -> bool:
                return read() >= 2

            await wait_until(second_read, timeout=30, message="the second start's reading read")
        rows = await db.fetch("SELECT ts, metrics FROM telemetry ORDER BY received_at")
        assert len(rows) == 2, "the second start's reading taken for a redelivery"
        # Stored as sent: device time is evidence, not truth (docs/behaviour.md).
        assert {r["ts"].year for r in rows} == {1970}
