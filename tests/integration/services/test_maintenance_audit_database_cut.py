"""A maintenance pass cut off by the database going away (docs/operations.md, "Retention").

The database cut under a pass (a restart, a failover, the network): the pass's connection is
lost, and asyncpg hands it back to its pool at once (a lost connection leaves the pool by
itself). The pass's ``finally`` then asked that connection whether it was closed, which asyncpg
refuses for one it no longer lends: the pass's own error was replaced by
``InterfaceError('cannot call Connection.is_closed(): connection has been released back to the
pool')``, the line the log showed. Now the pass's own error is raised (and logged by the
loop), and the lock goes with the lost session.

And the loop waited its whole interval before the next try (``[retention] interval_s``, an hour
by default): a pass failed by a restart of a few seconds was an hour of retention and partition
making lost. Now it is tried again within FAILURE_BACKOFF_CAP_S (30 s), and again at that pace
while the retry finds the lock still held by the cut pass's own session (its statement running
on the server, which notices the client gone only when it answers): that skip waited the
interval too. Real PostgreSQL, cut by a proxy at a chosen statement of the pass."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg
import pytest
from structlog.testing import capture_logs

from gateway.config import RetentionConfig
from gateway.maintenance.runner import Maintenance
from gateway.support.loops import FAILURE_BACKOFF_CAP_S
from gateway.support.metrics import Metrics
from storage.errors import DB_ERRORS
from storage.pool import create_pool
from tests.support.dsn import proxy_for, through
from tests.support.pg_cut import PgCut, Statement
from tests.support.waiting import wait_until

LAST_PASS = "gateway_maintenance_last_pass_timestamp_seconds"
# The pass's last statement before it lets the lock go: everything else of the pass ran.
LAST_STATEMENT = Statement("telemetry_oldest_day()")
# The pass's session, waiting on the test's row lock (in this test's database: the view spans
# the cluster, where other tests' passes wait on their own stream tickets).
WAITING = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock'
  AND query LIKE '%stream_ticket%' AND pid <> pg_backend_pid()
"""
# The errors asyncpg raises for a connection reset under it.
LOST = (OSError, asyncpg.exceptions.ConnectionDoesNotExistError, asyncpg.InterfaceError)


@dataclass
class Rig:
    maintenance: Maintenance
    cut: PgCut
    dsn: str  # through the proxy

    def last_pass(self) -> float:
        value = self.maintenance.metrics.registry.get_sample_value(LAST_PASS)
        return value or 0.0

    async def outage(self) -> None:
        """The cut has fallen: a client tries the database (refused), then it is back."""
        await wait_until(self.cut.fired.is_set, timeout=30, message="the cut fell")
        with pytest.raises(LOST):
            await asyncpg.connect(self.dsn, timeout=5)
        await self.cut.outage(timeout=30)


@asynccontextmanager
async def _rig(db_dsn: str) -> AsyncIterator[Rig]:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    try:
        cut = PgCut(proxy)
        dsn = through(db_dsn, proxy)
        pool = await create_pool(dsn, min_size=1, max_size=2)
        try:
            # The default interval: an hour between passes.
            retention = RetentionConfig(telemetry_days=30)
            assert retention.interval_s == 3600
            yield Rig(Maintenance(pool=pool, retention=retention, metrics=Metrics()), cut, dsn)
        finally:
            pool.terminate()
    finally:
        await proxy.stop()


async def _no_lock(db: asyncpg.Connection) -> bool:
    return await _advisory_locks(db) == 0


async def _advisory_locks(db: asyncpg.Connection) -> int:
    """Advisory locks held in this test's database (only the maintenance lock takes one)."""
    n: int = await db.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    return n


async def test_a_pass_cut_off_raises_its_own_error_and_leaves_no_lock(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    async with _rig(db_dsn) as rig:
        rig.cut.arm(LAST_STATEMENT, at="sent")
        with pytest.raises(DB_ERRORS) as raised:
            await rig.maintenance.run_once()
        # The connection's loss, not the pool's refusal to be asked about a connection it
        # already took back.
        assert "released back to the pool" not in repr(raised.value)
        assert isinstance(raised.value, LOST)
        await wait_until(
            lambda: _no_lock(db),
            timeout=30,
            message="the lost session's maintenance lock let go",
        )
        await rig.outage()
        # And the next pass takes it and runs.
        report = await rig.maintenance.run_once()
        assert report.ran
        assert await _advisory_locks(db) == 0


async def test_a_pass_failed_by_the_database_away_is_tried_again_soon_not_after_the_interval(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    async with _rig(db_dsn) as rig:
        rig.cut.arm(LAST_STATEMENT, at="sent")
        stop = asyncio.Event()
        with capture_logs() as logs:
            loop = asyncio.create_task(rig.maintenance.run(stop))
            try:
                await rig.outage()
                assert rig.last_pass() == 0  # the first pass failed at its last statement
                # Tried again within the failure backoff's cap (30 s), not an hour later.
                await wait_until(
                    lambda: rig.last_pass() > 0,
                    timeout=FAILURE_BACKOFF_CAP_S + 15,
                    message="a pass after the database came back",
                )
            finally:
                stop.set()
                await loop
        failed = [e for e in logs if e["event"] == "periodic_step_failed"]
        assert len(failed) == 1, failed
        assert failed[0]["loop"] == "maintenance"
        assert "released back to the pool" not in failed[0]["error"]
        assert failed[0]["retry_in_s"] <= FAILURE_BACKOFF_CAP_S
        assert await _advisory_locks(db) == 0


async def test_a_retry_that_finds_the_cut_passs_own_session_holding_the_lock_comes_again_soon(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    # An expired stream ticket, which every pass deletes, locked by the test: the pass's
    # DELETE waits on it, its statement running on the server when the link is cut.
    await db.execute(
        "INSERT INTO stream_ticket (digest, token_name, role, expires_at) "
        "VALUES (sha256('held'), 'maint', 'viewer', now() - interval '1 hour')"
    )
    holder = await asyncpg.connect(db_dsn)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute("SELECT 1 FROM stream_ticket WHERE digest = sha256('held') FOR UPDATE")
        async with _rig(db_dsn) as rig:
            stop = asyncio.Event()
            with capture_logs() as logs:
                loop = asyncio.create_task(rig.maintenance.run(stop))
                try:
                    await wait_until(
                        lambda: db.fetchval(WAITING), timeout=30, message="the pass waits"
                    )
                    # The link cut, the server told nothing (the node's host lost power and
                    # came back: no FIN, no reset), so client_connection_check_interval sees an
                    # open socket (a reset that reaches the server ends the statement sooner:
                    # test_maintenance_audit_client_gone). PostgreSQL notices this client gone
                    # only once it answers it: the pass's statement waits on, its session
                    # holding the maintenance lock, and the retry finds it taken.
                    rig.cut.proxy.reset_clients()
                    await wait_until(
                        lambda: any(e["event"] == "maintenance_skipped" for e in logs),
                        timeout=FAILURE_BACKOFF_CAP_S + 15,
                        message="the retry skipped: the cut pass's session holds the lock",
                    )
                    assert await _advisory_locks(db) == 1
                    await held.rollback()  # the statement ends, and its session with it
                    # Tried again within the cap, not an hour later.
                    await wait_until(
                        lambda: rig.last_pass() > 0,
                        timeout=FAILURE_BACKOFF_CAP_S + 15,
                        message="a pass once the cut pass's session let the lock go",
                    )
                finally:
                    stop.set()
                    await loop
            assert await db.fetchval("SELECT count(*) FROM stream_ticket") == 0
    finally:
        await holder.close()
