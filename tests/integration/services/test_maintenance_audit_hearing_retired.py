"""`command_hearing` holds one row per node id, written by each of its reaper passes (migration
0057); a node that has not passed for a minute no longer counts. A retired node's row used to
stay for ever: a fleet whose node ids change (containers with generated ids) grew the table
without bound, and every reaper pass read it. The maintenance pass deletes the rows of nodes
unseen for a day, far longer than one can count; a node that comes back afterwards simply
writes its row again.

Real daemons (their reapers write the rows) on a real mosquitto and PostgreSQL; the retired
node's last pass is dated back in the row itself, the pass runs on the database's clock.
"""

from __future__ import annotations

import functools
from datetime import datetime, timedelta

import asyncpg

from gateway.config import Config, RetentionConfig
from gateway.maintenance.runner import Maintenance
from gateway.support.metrics import Metrics
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

COMMANDS = "[commands]\nreaper_interval_s = 0.2\n"


async def passes(db: asyncpg.Connection) -> dict[str, datetime]:
    rows = await db.fetch("SELECT node_id, passed_at FROM command_hearing")
    return {r["node_id"]: r["passed_at"] for r in rows}


async def test_a_retired_nodes_hearing_row_is_pruned_and_written_again_when_it_returns(
    db_dsn: str, db: asyncpg.Connection, pool: asyncpg.Pool, mosquitto: Mosquitto
) -> None:
    def config(node_id: str) -> Config:
        return make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=node_id, extra=COMMANDS)

    # Three nodes pass, then stop: one (a generated id) two days ago, one an hour ago, one
    # seconds ago. (Each daemon's own maintenance pass, at its start, comes before the dating.)
    for node_id in ("gw-7f3a", "gw-recent", "gw-now"):
        async with running_daemon(config(node_id)):
            await wait_until(
                functools.partial(_has, db, node_id), timeout=30, message=f"{node_id} passed"
            )
    await db.execute(
        "UPDATE command_hearing SET passed_at = now() - interval '2 days',"
        " heard_through = now() - interval '2 days' WHERE node_id = 'gw-7f3a'"
    )
    await db.execute(
        "UPDATE command_hearing SET passed_at = now() - interval '1 hour',"
        " heard_through = now() - interval '1 hour' WHERE node_id = 'gw-recent'"
    )
    metrics = Metrics()
    report = await Maintenance(
        pool=pool, retention=RetentionConfig(telemetry_days=0), metrics=metrics
    ).run_once()
    assert report.ran
    assert set(await passes(db)) == {"gw-recent", "gw-now"}, (
        "a retired node's command_hearing row is never pruned"
    )
    assert report.deleted.get("command_hearing") == 1
    deleted = metrics.registry.get_sample_value(
        "gateway_retention_deleted_total", {"table": "command_hearing"}
    )
    assert deleted == 1
    # The retired id comes back (a container restarted with its old id): it writes its row anew.
    pruned_at: datetime = await db.fetchval("SELECT now()")
    async with running_daemon(config("gw-7f3a")):
        await wait_until(lambda: _has(db, "gw-7f3a"), timeout=30, message="gw-7f3a passed again")
    back = (await passes(db))["gw-7f3a"]
    assert back >= pruned_at - timedelta(seconds=1)


async def _has(db: asyncpg.Connection, node_id: str) -> bool:
    return bool(
        await db.fetchval(
            "SELECT EXISTS (SELECT 1 FROM command_hearing WHERE node_id = $1)", node_id
        )
    )
