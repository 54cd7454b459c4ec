"""A Sparkplug ``Float`` (a PLC's REAL, Ignition's Float4) travels as a 32-bit float: 80.1 is
sent as the float nearest to it, 80.09999847412109375. Widened to a double as it is, the gateway
stored and judged 80.0999984741211: a rule ``>= 80.1`` never fired on a device reporting 80.1,
``== 80.1`` never matched, and the console showed digits the device never had. A Float is read
as the shortest decimal that is the same 32-bit float (80.1), as Sparkplug hosts in Java do
(Float.toString). Against Eclipse Tahu's JavaScript client (npm ``sparkplug-client``), through a
real mosquitto to a real daemon and PostgreSQL."""

from __future__ import annotations

import json

import asyncpg

from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.sparkplug_edge import edge_node
from tests.support.waiting import wait_until

CONFIG = """
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["Plant1"]

[[rules]]
key = "level-high"
kind = "threshold"
metric = "level"
op = ">="
value = 80.1
severity = "CRITICAL"
devices = "Plant1/*"
"""


async def test_a_float_reported_as_80_1_is_80_1_to_the_rules(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=CONFIG)
    async with running_daemon(config), edge_node(mosquitto.port, "Plant1", "Line4") as edge:
        await edge.send(
            "nbirth", metrics=[{"name": "Uptime", "alias": 1, "type": "Int64", "value": 1}]
        )
        await edge.send(
            "dbirth",
            device="Tank",
            metrics=[{"name": "level", "alias": 10, "type": "Float", "value": 20.5}],
        )
        for value in (80.09, 80.1):
            await edge.send(
                "ddata", device="Tank", metrics=[{"alias": 10, "type": "Float", "value": value}]
            )

        conn = await asyncpg.connect(db_dsn)
        try:

            async def levels() -> list[float]:
                rows = await conn.fetch(
                    "SELECT metrics::text FROM telemetry WHERE device_id = 'Plant1/Line4/Tank'"
                    " ORDER BY ts, event_id"
                )
                return [json.loads(r[0])["level"] for r in rows]

            async def all_stored() -> bool:
                return len(await levels()) == 3

            # Alarms are decided in the transaction that stores the samples.
            await wait_until(all_stored, message="the birth and both readings stored")
            stored = await levels()
            alarms = await conn.fetch(
                "SELECT rule_key FROM alarm WHERE device_id = 'Plant1/Line4/Tank'"
            )
        finally:
            await conn.close()
    assert [a["rule_key"] for a in alarms] == ["level-high"], stored
    assert sorted(stored) == [20.5, 80.09, 80.1]  # two may share a millisecond
