"""A partition made over many waiting rows is made, however long the move takes, and the rest
of the pass goes on whatever becomes of it.

Samples of a day without its partition wait in the default partition (a fleet whose clocks
run more than ``partitions_ahead_days`` ahead, passes that did not run for longer than that)
and move when the day's partition is made, in one transaction. That statement ran under the
pool's command timeout (60 s in the field): a day too big to move in it timed out, rolled
back, and failed the whole pass, so that nothing was pruned anywhere, at every pass, for good,
each time holding ingest off for the full timeout. Here a pool whose command timeout is short
stands for it (the move of a few hundred thousand rows takes longer). Real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import date, timedelta

import asyncpg
import pytest

from gateway.config import RetentionConfig
from gateway.maintenance.runner import Maintenance
from gateway.support.metrics import Metrics
from storage.pool import create_pool
from tests.support.waiting import wait_until

ROWS = 300_000
TIMEOUT_S = 0.3


@pytest.fixture
async def short_pool(db_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool whose statements time out after TIMEOUT_S (as the daemon's do after 60 s)."""
    pool = await create_pool(db_dsn, min_size=1, max_size=2, command_timeout_s=TIMEOUT_S)
    try:
        yield pool
    finally:
        await pool.close()


async def test_a_big_day_is_moved_into_its_partition_and_the_rest_is_pruned(
    short_pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    today: date = await db.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    day = today + timedelta(days=20)  # a fleet's clocks 20 days ahead: no partition yet
    await db.execute(
        "INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, node_id) "
        "SELECT encode(sha256(g::text::bytea), 'hex'), 'dev-' || (g % 500), "
        "$1::timestamp AT TIME ZONE 'UTC' + g * interval '250 ms', g, "
        "'{\"temp\": 20.5}', 'n1' FROM generate_series(1, $2) AS g",
        day,
        ROWS,
    )
    await db.execute(
        "INSERT INTO dead_letter (topic, payload, payload_size, payload_sha256, reason, detail, "
        "node_id, received_at, last_seen_at) VALUES ('t', 'x', 1, encode(sha256('x'), 'hex'), "
        "'INVALID', 'bad', 'n1', now() - interval '40 days', now() - interval '40 days')"
    )
    maintenance = Maintenance(
        pool=short_pool,
        retention=RetentionConfig(telemetry_days=30, dead_letter_days=30, partitions_ahead_days=20),
        metrics=Metrics(),
    )

    report = await maintenance.run_once()

    assert day in report.created
    assert report.deleted["dead_letter"] == 1
    moved = await db.fetchval(
        f"SELECT count(*) FROM telemetry_p{day:%Y%m%d}"  # noqa: S608 - a day's partition name
    )
    assert moved == ROWS
    assert await db.fetchval("SELECT count(*) FROM telemetry_default") == 0


async def test_a_partition_change_cancelled_by_an_operator_leaves_the_rest_of_the_pass_going(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """A DBA cancels (pg_cancel_backend) the partition change that holds ingest off; the pass
    does its pruning anyway, and the change comes again at the next pass."""
    today: date = await db.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    await db.execute(
        "INSERT INTO dead_letter (topic, payload, payload_size, payload_sha256, reason, detail, "
        "node_id, received_at, last_seen_at) VALUES ('t', 'x', 1, encode(sha256('x'), 'hex'), "
        "'INVALID', 'bad', 'n1', now() - interval '40 days', now() - interval '40 days')"
    )
    maintenance = Maintenance(
        pool=pool,
        retention=RetentionConfig(telemetry_days=30, dead_letter_days=30, partitions_ahead_days=20),
        metrics=Metrics(),
        partition_lock_timeout="60s",
    )
    missing = [
        d for d in (today + timedelta(days=n) for n in range(21)) if d not in await _parts(db)
    ]
    first = missing[0]
    writer = await asyncpg.connect(db_dsn)  # an ingest transaction in flight
    try:
        batch = writer.transaction()
        await batch.start()
        await writer.execute("LOCK TABLE telemetry IN ROW EXCLUSIVE MODE")
        passing = asyncio.create_task(maintenance.run_once())
        waiting = await _wait_for_change(db)
        assert await db.fetchval("SELECT pg_cancel_backend($1)", waiting["pid"])

        async def moved_on() -> bool:
            """The cancelled change is over: the pass waits on the next day's, or ended."""
            now_waiting = await _waiting_change(db)
            return passing.done() or (
                now_waiting is not None and now_waiting["xact_start"] != waiting["xact_start"]
            )

        await wait_until(moved_on, message="the pass past the cancelled change")
        await batch.commit()
        report = await passing
    finally:
        await writer.close()

    assert report.ran
    assert first not in report.created
    assert report.created == missing[1:]
    assert report.deleted["dead_letter"] == 1
    assert (await maintenance.run_once()).created == [first]


async def _parts(db: asyncpg.Connection) -> list[date]:
    rows = await db.fetch(
        "SELECT to_date(substr(c.relname, 12), 'YYYYMMDD') AS day FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'telemetry'::regclass "
        "AND c.relname ~ '^telemetry_p' ORDER BY 1"
    )
    return [r["day"] for r in rows]


async def _waiting_change(db: asyncpg.Connection) -> asyncpg.Record | None:
    row: asyncpg.Record | None = await db.fetchrow(
        "SELECT pid, xact_start FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE '%telemetry_add_day_partition%'"
    )
    return row


async def _wait_for_change(db: asyncpg.Connection) -> asyncpg.Record:
    await wait_until(lambda: _waiting_change(db), message="the partition change waits for its lock")
    row = await _waiting_change(db)
    assert row is not None
    return row
