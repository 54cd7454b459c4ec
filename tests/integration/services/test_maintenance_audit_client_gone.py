"""A maintenance pass whose connection is closed under a running statement lets the lock go as
soon as PostgreSQL sees the client gone, not when the statement ends (docs/operations.md,
"Retention and disk").

A link cut (the node's host reset, a firewall REJECT, the proxy's reset here) while a pass's
statement runs on the server left that statement running, and its session holding the
maintenance lock, until the statement ended and the server tried to answer: a prune waiting on
a row lock, or a partition change moving a big day, held every node's maintenance off for as
long. The lock holder's session now has ``client_connection_check_interval`` set (in the
statement that takes the lock, reset at unlock, as ``idle_session_timeout``): PostgreSQL looks
at the client's socket while a statement runs, ends the statement and the session when that
socket is closed, and another node takes the lock. Real PostgreSQL behind a TCP proxy whose
reset reaches the server's socket; a silent peer (no FIN, no reset) is not covered, and is not
tested here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import pytest

from gateway.config import RetentionConfig
from gateway.maintenance.runner import Maintenance
from gateway.support.metrics import Metrics
from storage import maintenance as repo
from storage.pool import create_pool
from tests.support.dsn import proxy_for, through
from tests.support.waiting import wait_until

# The pass's session, waiting on the test's row lock (in this test's database only).
WAITING = """
SELECT pid FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE '%stream_ticket%' AND pid <> pg_backend_pid()
  AND datname = current_database()
"""
LOST = (OSError, asyncpg.exceptions.ConnectionDoesNotExistError, asyncpg.InterfaceError)


@asynccontextmanager
async def _held_ticket(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[None]:
    """An expired stream ticket (every pass deletes it) locked by the test until the end: the
    pass's DELETE waits on it, its statement running on the server."""
    await db.execute(
        "INSERT INTO stream_ticket (digest, token_name, role, expires_at) "
        "VALUES (sha256('held'), 'maint', 'viewer', now() - interval '1 hour')"
    )
    holder = await asyncpg.connect(db_dsn)
    try:
        async with holder.transaction():
            await holder.execute(
                "SELECT 1 FROM stream_ticket WHERE digest = sha256('held') FOR UPDATE"
            )
            yield
    finally:
        await holder.close()


async def _lock_free(db_dsn: str) -> bool:
    """Another node's session can take the maintenance lock (and lets it go at once)."""
    other = await asyncpg.connect(db_dsn)
    try:
        if not await repo.try_lock(other):
            return False
        await repo.unlock(other)
        return True
    finally:
        await other.close()


async def test_a_pass_cut_under_a_running_statement_lets_the_lock_go_before_the_statement_ends(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    try:
        pool = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
        try:
            maintenance = Maintenance(
                pool=pool, retention=RetentionConfig(telemetry_days=30), metrics=Metrics()
            )
            async with _held_ticket(db_dsn, db):
                running = asyncio.create_task(maintenance.run_once())
                await wait_until(lambda: db.fetchval(WAITING), timeout=30, message="the pass waits")
                assert not await _lock_free(db_dsn)
                proxy.reset_all()  # the link cut: both sockets reset, the server's too
                with pytest.raises(LOST):
                    await running
                # The row lock is still held: the cut statement has not ended by itself. The
                # server saw its client gone and ended it, and the lock went with the session.
                await wait_until(
                    lambda: _lock_free(db_dsn),
                    timeout=repo.LOCK_HOLDER_CHECK_S + 15,
                    message="another node can take the maintenance lock",
                )
                assert await db.fetchval(WAITING) is None
        finally:
            pool.terminate()
    finally:
        await proxy.stop()


async def test_the_check_is_set_with_the_lock_and_reset_with_it(db_dsn: str) -> None:
    first = await asyncpg.connect(db_dsn)
    second = await asyncpg.connect(db_dsn)
    try:
        default = await first.fetchval("SHOW client_connection_check_interval")
        assert await repo.try_lock(first, check_s=2.5)
        assert await first.fetchval("SHOW client_connection_check_interval") == "2500ms"
        # A session that did not get the lock is left as it was (a pooled connection).
        assert not await repo.try_lock(second, check_s=2.5)
        assert await second.fetchval("SHOW client_connection_check_interval") == default
        await repo.unlock(first)
        assert await first.fetchval("SHOW client_connection_check_interval") == default
    finally:
        await first.close()
        await second.close()
