"""An edge node with thousands of tags (an Ignition gateway's) sends an NBIRTH far larger than
its data: every metric's name, alias and type. Refused as OVERSIZED by ``[mqtt]
max_payload_bytes`` (64 KiB), the node was never born: each of its messages a
``SPARKPLUG_NOT_BORN`` dead letter, a rebirth request every ``rebirth_retry_s`` answered by the
same birth, forever. Births have their own bound, ``[sparkplug] max_birth_bytes`` (1 MiB).
Against Eclipse Tahu's JavaScript client, a real mosquitto, daemon and PostgreSQL."""

from __future__ import annotations

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
"""
TAGS = 2500  # about 150 KB of NBIRTH, over 64 KiB


def _tags() -> list[dict[str, object]]:
    return [
        {
            "name": f"Area1/Line3/Machine_{n:04d}/Spindle_Temperature_Setpoint",
            "alias": 100 + n,
            "type": "Float",
            "value": 20.5,
        }
        for n in range(TAGS)
    ]


async def _letters(db: asyncpg.Connection) -> list[tuple[str, str]]:
    rows = await db.fetch("SELECT reason, detail FROM dead_letter ORDER BY id")
    return [(r["reason"], r["detail"]) for r in rows]


async def test_a_birth_over_max_payload_bytes_is_born_and_its_data_stored(
    db_dsn: str, mosquitto: Mosquitto, db: asyncpg.Connection
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=CONFIG)
    async with running_daemon(config), edge_node(mosquitto.port, "Plant1", "Line4") as edge:
        await edge.send("nbirth", metrics=_tags())
        await edge.send(
            "dbirth",
            device="Tank",
            metrics=[{"name": "level", "alias": 10, "type": "Float", "value": 20.5}],
        )
        await edge.send(
            "ddata", device="Tank", metrics=[{"alias": 10, "type": "Float", "value": 42}]
        )

        async def stored() -> bool:
            return bool(
                await db.fetchval(
                    "SELECT count(*) FROM telemetry WHERE device_id = 'Plant1/Line4/Tank'"
                    " AND metrics ? 'level' AND (metrics->>'level')::float8 = 42"
                )
            )

        await wait_until(stored, message="the device's data after the node's large birth")
        node = await db.fetchrow(
            "SELECT metrics FROM telemetry WHERE device_id = 'Plant1/Line4' ORDER BY ts LIMIT 1"
        )
    assert await _letters(db) == []
    assert node is not None  # the birth's own metrics, stored as the node's sample


async def test_a_birth_over_max_birth_bytes_is_a_letter_naming_the_key(
    db_dsn: str, mosquitto: Mosquitto, db: asyncpg.Connection
) -> None:
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, extra=CONFIG + "max_birth_bytes = 100000\n"
    )
    async with running_daemon(config), edge_node(mosquitto.port, "Plant1", "Line4") as edge:
        await edge.send("nbirth", metrics=_tags())

        async def refused() -> bool:
            return any(reason == "OVERSIZED" for reason, _ in await _letters(db))

        await wait_until(refused, message="the birth dead-lettered")
    [(_, detail)] = [letter for letter in await _letters(db) if letter[0] == "OVERSIZED"]
    assert "the limit for births is 100000 ([sparkplug] max_birth_bytes)" in detail
