"""The stream hub audit: the database under a running node fails over to a server that is
behind (an asynchronous standby, a restore), whose transaction ids and outbox ids are lower
than the hub's head. The hub must not go on waiting for events past its old head: live
streams would stay open and silent (behaviour §9: every outbox event, live)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest

from gateway.api.stream import StreamHub
from storage.migrate import migrate
from storage.pool import create_pool
from tests.integration.services.test_ingest_lost_commit import _reachable, _start_server, _stop
from tests.integration.services.test_stream_hub import _Body, _events, _passes_until
from tests.support.dsn import proxy_for, through
from tests.support.ha_postgres import PG_BIN
from tests.support.waiting import wait_until


@pytest.fixture
async def behind_dsn(db_dsn: str) -> AsyncIterator[str]:
    """The test's database, migrated, on a PostgreSQL of the test's own: the standby that is
    behind (same database name, so one DSN through a proxy reaches either)."""
    if not (PG_BIN / "postgres").exists():
        pytest.skip(f"{PG_BIN / 'postgres'} missing")
    name = urlsplit(db_dsn).path.lstrip("/")
    home = Path(tempfile.mkdtemp(prefix="gw-behind-"))
    server, port = await asyncio.to_thread(_start_server, home)
    try:
        base = f"postgresql://postgres@127.0.0.1:{port}"
        await wait_until(lambda: _reachable(f"{base}/postgres"), timeout=60, message="up")
        admin = await asyncpg.connect(f"{base}/postgres")
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        conn = await asyncpg.connect(f"{base}/{name}")
        try:
            await migrate(conn)
        finally:
            await conn.close()
        yield f"{base}/{name}"
    finally:
        await asyncio.to_thread(_stop, server)
        shutil.rmtree(home, ignore_errors=True)


async def _insert(dsn: str, names: list[str]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        pool_like = _OneConn(conn)
        await _events(pool_like, names)  # type: ignore[arg-type]
    finally:
        await conn.close()


class _OneConn:
    """``pool.acquire()`` over one connection (for ``_events``)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    def acquire(self) -> _OneConn:
        return self

    async def __aenter__(self) -> asyncpg.Connection:
        return self.conn

    async def __aexit__(self, *exc: object) -> None:
        return None


async def test_a_failover_to_a_server_behind_does_not_silence_the_streams(
    db_dsn: str, behind_dsn: str
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    dsn = through(db_dsn, proxy)
    pool = await create_pool(dsn, min_size=1, max_size=2)
    try:
        hub = StreamHub(pool, dsn, node_id="hub-test")
        assert await hub.run_once() == 0
        watcher = _Body(hub, None)
        assert await watcher.next() is None
        await _events(pool, ["on-primary"])
        await _passes_until(hub, 1)
        seen = await watcher.event()
        assert seen.data["aggregate_id"] == "on-primary"
        head = hub.head
        assert head is not None
        behind = await asyncpg.connect(behind_dsn)
        try:
            assert int(await behind.fetchval("SELECT pg_current_xact_id()::text")) < head.xid
        finally:
            await behind.close()

        # The failover: the same address now reaches the server that is behind.
        host = urlsplit(behind_dsn)
        proxy.target_host, proxy.target_port = host.hostname or "127.0.0.1", host.port or 5432
        proxy.target_unix = None
        await proxy.cut()
        await proxy.resume()
        await _insert(behind_dsn, ["on-standby"])

        async def passed() -> bool:
            try:
                await hub.run_once()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                return False  # the pool's connection to the old primary, reset
            return True

        await wait_until(passed, message="a hub pass on the new primary")
        fresh = _Body(hub, None)  # a client that starts now
        assert await fresh.next() is None
        await _insert(behind_dsn, ["after-failover"])

        async def fanned_out() -> bool:
            await hub.run_once()
            return bool(fresh.pending) or hub.streams < 2

        try:
            await wait_until(fanned_out, timeout=10, message="an event after the failover")
        except AssertionError:
            pytest.fail(f"the hub, its head {hub.head} past the new primary's, sends nothing")
        async with asyncio.timeout(10):
            got = await fresh.event()
        assert got.data["aggregate_id"] == "after-failover"
        await fresh.close()
        await watcher.close()
    finally:
        await pool.close()
        await proxy.stop()
