"""A stop (SIGTERM, Ctrl-C) while the node waits for the migration: another node of the cluster
migrates the schema (holds the migration lock), for as long as its conversion takes. The node
must stop promptly (systemd's TimeoutStopSec is 45 s, then SIGKILL), not wait for the other
node's migration to end.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg

from gateway.runtime.daemon import Daemon
from storage.migrate import (
    MIGRATION_LOCK_KEY,
    latest_version,
    schema_version,
)
from tests.support.daemon import make_config
from tests.support.mosquitto import Mosquitto
from tests.support.schema import last_migration_table, schema_before
from tests.support.waiting import wait_until

NODE = "upgrade-audit"
# Well below systemd's TimeoutStopSec (45 s) and the pool's command timeout (60 s).
STOP_WITHIN_S = 15.0


async def _stop_while_waiting(dsn: str, mosquitto: Mosquitto) -> None:
    """Start a node, stop it once its migration waits for a lock: it must end promptly."""
    observer = await asyncpg.connect(dsn)
    daemon = Daemon(make_config(dsn=dsn, mqtt_port=mosquitto.port, node_id=NODE))
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:

        async def waiting_for_the_lock() -> bool:
            return bool(
                await observer.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = $1 AND wait_event_type = 'Lock'",
                    f"gateway:{NODE}",
                )
            )

        await wait_until(waiting_for_the_lock, timeout=30, message="the node waits")
        stop.set()
        started = time.monotonic()
        done, _ = await asyncio.wait({task}, timeout=STOP_WITHIN_S)
        assert done, f"still starting {STOP_WITHIN_S} s after the stop"
        task.result()
        assert time.monotonic() - started < STOP_WITHIN_S
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await observer.close()


async def test_a_stop_while_another_node_migrates_ends_the_start_promptly(
    empty_db_dsn: str, mosquitto: Mosquitto
) -> None:
    other_node = await asyncpg.connect(empty_db_dsn)
    try:
        await other_node.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        await _stop_while_waiting(empty_db_dsn, mosquitto)
        # The node stopped without migrating anything, and left the lock alone.
        assert await schema_version(other_node) == 0
        assert not await other_node.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = $1",
            f"gateway:{NODE}",
        )
    finally:
        await other_node.close()


async def test_a_stop_during_the_nodes_own_migration_rolls_it_back_and_frees_the_lock(
    empty_db_dsn: str, mosquitto: Mosquitto
) -> None:
    latest = latest_version()
    backup = await asyncpg.connect(empty_db_dsn)
    try:
        # The release before the last migration, with a backup reading the table the last
        # migration alters: the migration waits (as a long conversion would run).
        await schema_before(backup, latest)
        table = last_migration_table()
        await backup.execute("BEGIN")
        await backup.execute(f"LOCK TABLE {table} IN ACCESS SHARE MODE")
        await _stop_while_waiting(empty_db_dsn, mosquitto)
        await backup.execute("COMMIT")
        # Rolled back: the next start runs it; and the migration lock is free.
        assert await schema_version(backup) == latest - 1
        assert await backup.fetchval("SELECT pg_try_advisory_lock($1)", MIGRATION_LOCK_KEY)
    finally:
        await backup.close()
