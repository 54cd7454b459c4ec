"""A dead letter replayed while a Sparkplug write is open does not confirm it.

Sparkplug has no receipt: a write (`DCMD`) is confirmed by the device reporting the written
value back. The confirmation compared the value only: a `DDATA` received long before the
command (a dead letter, here data before the edge node's birth) that an operator replays while
the write is open confirmed it (`ACKED`) if it happened to hold the value, though the device
never applied the write. Only data received after the command was sent confirms it.

Eclipse Tahu's JavaScript client (`edge.js`, not applying the write), a real mosquitto, daemon
and PostgreSQL, the letter replayed as `POST /dead-letters/{id}/replay` does (`replay_one`)."""

from __future__ import annotations

import asyncpg

from gateway.domain.command import Delivery
from gateway.ingest.replay import replay_one
from storage.pool import create_pool
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.sparkplug_edge import edge_node
from tests.support.waiting import wait_until

SPARKPLUG = """
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["Plant1"]

[commands]
ack_window_s = 600
reaper_interval_s = 0.2
"""

NODE_METRICS = [{"name": "Uptime", "alias": 1, "type": "Int64", "value": 7}]
OVEN_METRICS = [{"name": "setpoint", "alias": 13, "type": "Float", "value": 20.0}]


async def _fetch(dsn: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


async def _status(dsn: str, command_id: int) -> str:
    [row] = await _fetch(dsn, "SELECT status FROM command WHERE id = $1", command_id)
    return str(row["status"])


async def test_a_replayed_ddata_holding_the_written_value_does_not_confirm_the_write(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG)
    async with (
        running_daemon(config) as daemon,
        edge_node(mosquitto.port, "Plant1", "Line4") as edge,
    ):
        # The device reports 42.5 before any birth: a dead letter.
        await edge.send(
            "ddata", device="Oven", metrics=[{"name": "setpoint", "type": "Float", "value": 42.5}]
        )

        async def lettered() -> bool:
            rows = await _fetch(db_dsn, "SELECT topic FROM dead_letter")
            return [r["topic"] for r in rows] == ["spBv1.0/Plant1/DDATA/Line4/Oven"]

        await wait_until(lettered, timeout=30, message="the data before birth dead-lettered")
        await edge.send("nbirth", metrics=NODE_METRICS)
        await edge.send("dbirth", device="Oven", metrics=OVEN_METRICS)

        async def born() -> bool:
            rows = await _fetch(
                db_dsn,
                "SELECT devices FROM sparkplug_node WHERE group_id = 'Plant1'"
                " AND edge_node_id = 'Line4' AND born",
            )
            return bool(rows) and list(rows[0]["devices"]) == ["Oven"]

        await wait_until(born, timeout=30, message="the device born")
        await edge.send("echo", on=False)  # the device does not apply the write
        service = daemon.services.commands
        assert service is not None
        write = await service.create(
            device_id="Plant1/Line4/Oven",
            name="setpoint",
            params={"value": 42.5},
            delivery=Delivery.REALTIME,
            idempotency_key="sp-replay",
            actor="test",
        )
        await edge.wait_for(lambda: edge.count("dcmd") >= 1, "the DCMD", timeout=30)

        async def sent() -> bool:
            return await _status(db_dsn, write.command.id) == "SENT"

        await wait_until(sent, timeout=30, message="the write sent")
        [letter] = await _fetch(db_dsn, "SELECT id FROM dead_letter")
        path = daemon.services.replay_path
        assert path is not None
        pool = await create_pool(db_dsn, min_size=1, max_size=2)
        try:
            outcome = await replay_one(pool, path, letter["id"])
        finally:
            await pool.close()
        assert outcome is not None
        assert (outcome.outcome, outcome.succeeded) == ("stored", True)
        assert await _status(db_dsn, write.command.id) == "SENT", "confirmed by a replay"
