"""A migration longer than the pool's command timeout (60 s in the daemon and the CLI).

The migration runs on a connection of the node's pool, whose calls are bounded by its command
timeout. A migration that converts a large table (0012: about 20 s per million rows,
docs/operations.md) or one that waits for a lock (a backup reading the table, another node
migrating) was cancelled at that bound: rolled back, retried by the daemon, cancelled again, so
an installation with more rows than the bound allows could never be upgraded. Here the pool's
bound is 1 s, and the migration is held past it by a backup's lock, then by another node
holding the migration lock; it must complete once they let go.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg

from storage.migrate import (
    MIGRATION_LOCK_KEY,
    latest_version,
    migrate,
    schema_version,
)
from storage.pool import create_pool
from tests.support.schema import last_migration_table, schema_before

COMMAND_TIMEOUT_S = 1.0
# How long the migration is held: well past the bound.
HELD_S = 3 * COMMAND_TIMEOUT_S
APP = "gateway:upgrade-audit"


async def _wait_blocked(observer: asyncpg.Connection) -> None:
    """Until the migrating connection waits for a lock (deadline 10 s)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        waiting = await observer.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = $1 AND wait_event_type IN ('Lock', 'Advisory')",
            APP,
        )
        if waiting:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the migration never waited for the lock")


async def _migrate_held_past_the_timeout(dsn: str, hold: asyncpg.Connection) -> list[int]:
    pool = await create_pool(
        dsn, min_size=1, max_size=1, command_timeout_s=COMMAND_TIMEOUT_S, application_name=APP
    )
    try:

        async def run() -> list[int]:
            async with pool.acquire() as conn:
                return await migrate(conn)

        task = asyncio.create_task(run())
        await _wait_blocked(hold)
        # The holder keeps its lock for HELD_S: the migration must still be waiting then.
        done, _ = await asyncio.wait({task}, timeout=HELD_S)
        if done:
            task.result()  # its exception, if it failed
            raise AssertionError("the migration ended while its lock was still held")
        return await _release_then(hold, task)
    finally:
        await pool.close()


async def _release_then(hold: asyncpg.Connection, task: asyncio.Task[list[int]]) -> list[int]:
    if hold.is_in_transaction():
        await hold.execute("COMMIT")
    else:
        await hold.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    return await asyncio.wait_for(task, timeout=30.0)


async def test_a_migration_held_past_the_command_timeout_by_a_backup_completes(
    empty_db_dsn: str,
) -> None:
    latest = latest_version()
    setup = await asyncpg.connect(empty_db_dsn)
    hold = await asyncpg.connect(empty_db_dsn)
    try:
        # The release before the last migration, with a backup (pg_dump: ACCESS SHARE on
        # every table, for as long as it takes) reading the table the last one alters.
        await schema_before(setup, latest)
        table = last_migration_table()
        await hold.execute("BEGIN")
        await hold.execute(f"LOCK TABLE {table} IN ACCESS SHARE MODE")
        applied = await _migrate_held_past_the_timeout(empty_db_dsn, hold)
        assert applied == [latest]
        assert await schema_version(setup) == latest
    finally:
        await hold.close()
        await setup.close()


async def test_a_node_waiting_past_the_command_timeout_for_another_nodes_migration_starts(
    empty_db_dsn: str,
) -> None:
    latest = latest_version()
    setup = await asyncpg.connect(empty_db_dsn)
    hold = await asyncpg.connect(empty_db_dsn)
    try:
        # Another node migrates (holds the migration lock) for longer than the bound, and
        # finishes: this node then finds nothing left to do.
        await hold.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        await schema_before(setup, latest + 1)
        applied = await _migrate_held_past_the_timeout(empty_db_dsn, hold)
        assert applied == []
        assert await schema_version(setup) == latest
    finally:
        await hold.close()
        await setup.close()
