"""A running node whose schema a newer release migrated (a rolling upgrade) finds out within
seconds and stops as at SIGTERM; a migration by its own release, or none, changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg
import pytest

from gateway.config import Config
from gateway.runtime import schema_watch
from gateway.runtime.daemon import Daemon
from gateway.runtime.schema_watch import SchemaWatch
from storage.migrate import MIGRATED_CHANNEL, RECORD, latest_version, migrate
from tests.support.daemon import READY_TIMEOUT_S, make_config, session_up
from tests.support.mosquitto import Mosquitto
from tests.support.newer_release import migrate_as_newer_release
from tests.support.waiting import wait_until

# Well under the fallback's 30 s: what the NOTIFY buys.
PROMPTLY_S = 10.0


async def test_the_check_finds_a_newer_schema_and_nothing_else(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    heard: list[int] = []
    watch = SchemaWatch(pool, db_dsn, on_newer=heard.append)
    assert await watch.check_once() is None
    async with pool.acquire() as conn:
        assert await migrate(conn) == []  # this release again: nothing to do
    assert await watch.check_once() is None
    newer = await migrate_as_newer_release(db_dsn)
    assert await watch.check_once() == newer
    assert heard == []  # the run-once check calls nobody


@contextlib.asynccontextmanager
async def _daemon(
    config: Config,
) -> AsyncIterator[tuple[Daemon, asyncio.Event, asyncio.Task[None]]]:
    daemon = Daemon(config)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop), name=f"daemon-{config.node_id}")
    try:
        await wait_until(
            lambda: task.done() or daemon.ready.is_set(), timeout=READY_TIMEOUT_S, message="ready"
        )
        assert not task.done(), "the daemon ended before it was ready"
        yield daemon, stop, task
    finally:
        stop.set()
        async with asyncio.timeout(60):
            await asyncio.gather(task, return_exceptions=True)


def _checked(daemon: Daemon) -> bool:
    """The daemon's schema watch has looked once (and LISTENs)."""
    return daemon.schema_watch is not None and daemon.schema_watch.checks > 0


def _config(db_dsn: str, mosquitto: Mosquitto, node: str) -> Config:
    return make_config(
        dsn=db_dsn,
        mqtt_port=mosquitto.port,
        node_id=node,
        mqtt_extra='shared_group = "upgrade"',
    )


async def test_running_nodes_stop_within_seconds_of_a_newer_release_migrating(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with (
        _daemon(_config(db_dsn, mosquitto, "node-a")) as (a, _, a_task),
        _daemon(_config(db_dsn, mosquitto, "node-b")) as (b, _, b_task),
    ):
        await wait_until(lambda: _checked(a) and _checked(b), timeout=30, message="first check")
        newer = await migrate_as_newer_release(db_dsn)
        # Heard at the migration's commit: well before the periodic check (30 s) came round.
        await wait_until(
            lambda: a.schema_upgraded == b.schema_upgraded == newer,
            timeout=PROMPTLY_S,
            message="both nodes found the newer schema",
        )
        # Each then stops by itself, as at SIGTERM (the drain, the offline status).
        async with asyncio.timeout(60):
            await asyncio.gather(a_task, b_task)


async def test_a_migration_by_the_same_release_changes_nothing(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with _daemon(_config(db_dsn, mosquitto, "node-a")) as (a, _, a_task):
        watch = a.schema_watch
        assert watch is not None
        await wait_until(lambda: watch.checks > 0, timeout=30, message="first check")
        before = watch.checks
        conn = await asyncpg.connect(db_dsn)
        try:
            assert await migrate(conn) == []
            # What this release's migrator sends at a commit (another node of it migrated).
            await conn.execute("SELECT pg_notify($1, $2)", MIGRATED_CHANNEL, str(latest_version()))
        finally:
            await conn.close()
        await wait_until(lambda: watch.checks > before, timeout=PROMPTLY_S, message="heard")
        assert a.schema_upgraded is None
        assert not a_task.done()
        assert session_up(a)


async def test_a_newer_schema_without_a_notification_is_found_by_the_periodic_check(
    db_dsn: str, mosquitto: Mosquitto, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release that sends no NOTIFY, or one missed while the LISTEN connection was down."""
    monkeypatch.setattr(schema_watch, "SCHEMA_POLL_S", 0.5)
    async with _daemon(_config(db_dsn, mosquitto, "node-a")) as (a, _, a_task):
        conn = await asyncpg.connect(db_dsn)
        try:
            await conn.execute(RECORD, latest_version() + 1, "future", "x")
        finally:
            await conn.close()
        async with asyncio.timeout(PROMPTLY_S + 30):
            await a_task
        assert a.schema_upgraded == latest_version() + 1
