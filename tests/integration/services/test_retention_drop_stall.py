"""Dropping a big day partition past the window holds ingest off for a moment only
(docs/operations.md, "Telemetry partitions": "Creating or dropping a partition holds ingest off
for the moment it takes (milliseconds ...)").

A day past the window is detached, under an ACCESS EXCLUSIVE lock on ``telemetry`` that every
ingest transaction waits for, and its rows received inside the window are copied out before it
is dropped. That copy looked for them by reading the whole day: PostgreSQL planned a sequential
scan (a day never analysed), or read every block range the BRIN index on ``received_at`` had
not summarised yet (autovacuum summarises as it vacuums, and an insert-only day's last fifth
or so is never vacuumed once the day is over): at full rate, seconds to tens of seconds of
ingest held every day. Real PostgreSQL; a writer stores a sample every few milliseconds, as the
ingest path does, while a real maintenance pass drops the day."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import asyncpg

from gateway.config import RetentionConfig
from gateway.maintenance.runner import Maintenance, day_start, utc_day
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id
from storage.ingest import TelemetryRow, insert_telemetry

ROWS = 1_000_000
# What one ingest transaction may wait while the day goes: far above a batch's own time here,
# far below what reading the day under the lock took (0.5-1 s for these rows on this host).
MAX_WAIT_S = 0.25


async def test_a_big_day_is_dropped_without_holding_ingest(
    pool: asyncpg.Pool, db: asyncpg.Connection, db_dsn: str
) -> None:
    now: datetime = await db.fetchval("SELECT now()")
    old = utc_day(now) - timedelta(days=40)
    assert await db.fetchval("SELECT telemetry_add_day_partition($1)", old)
    # A day of a fleet at full rate, received that day (a few late ones are not needed: the
    # rows kept are found by the index either way).
    await db.execute(
        """
        INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, received_at, node_id)
        SELECT md5(i::text) || md5((-i)::text), 'dev-' || (i % 100), t, i, '{"temp": 20.5}', t,
               'n1'
        FROM generate_series(1, $2::int) AS i,
             LATERAL (SELECT $1::timestamptz + i * interval '80 ms' AS t) AS s
        """,
        day_start(old),
        ROWS,
    )

    writer = await asyncpg.connect(db_dsn)
    done = asyncio.Event()
    waits: list[float] = []

    async def ingest() -> None:
        seq = 0
        while not done.is_set():
            seq += 1
            message = Telemetry(ts=datetime.now(UTC), seq=seq, metrics={"temp": 21.0})
            row = TelemetryRow(
                event_id=telemetry_event_id("live", message), device_id="live",
                ts_us=message.micros(), seq=seq, metrics_json='{"temp": 21.0}',
                events_json=None,
            )  # fmt: skip
            started = time.monotonic()
            async with writer.transaction():
                await insert_telemetry(writer, [row], "n1")
            waits.append(time.monotonic() - started)
            await asyncio.sleep(0.005)  # a batch every few ms, not a timing wait

    maintenance = Maintenance(
        pool=pool, retention=RetentionConfig(telemetry_days=30), metrics=Metrics()
    )
    # Today's partitions first (keeping every day), so that the pass measured below only
    # drops the old one.
    await Maintenance(
        pool=pool, retention=RetentionConfig(telemetry_days=0), metrics=Metrics()
    ).run_once()
    task = asyncio.create_task(ingest())
    try:
        report = await maintenance.run_once()
    finally:
        done.set()
        await task
        await writer.close()
    assert report.dropped == [old]
    assert waits
    assert max(waits) < MAX_WAIT_S, (
        f"ingest held {max(waits):.3f} s while the day was dropped ({len(waits)} batches)"
    )
