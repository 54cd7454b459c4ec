"""Retention of telemetry: day partitions made ahead and dropped, the default partition, and
the exactly-once dedup inside the window. Real PostgreSQL, an injected clock, no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, date, datetime, timedelta

import asyncpg
import pytest

from gateway.config import RetentionConfig
from gateway.maintenance.runner import MEASURED_TABLES, Maintenance, day_start, utc_day
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id
from storage.ingest import TelemetryRow, insert_telemetry
from storage.pool import create_pool
from tests.support.waiting import wait_until

NOW = datetime.now(UTC)
TODAY = utc_day(NOW)


@pytest.fixture(autouse=True)
def _now() -> None:
    """Each test's time, taken as it starts: taken at import, a run that crossed midnight UTC
    compared yesterday's clock with rows the database had received today."""
    global NOW, TODAY  # noqa: PLW0603  # read by every test and helper of the module
    NOW = datetime.now(UTC)
    TODAY = utc_day(NOW)


def sample(device: str, ts: datetime, seq: int) -> TelemetryRow:
    message = Telemetry(ts=ts, seq=seq, metrics={"temp": 20.5 + seq})
    return TelemetryRow(
        event_id=telemetry_event_id(device, message),
        device_id=device,
        ts_us=message.micros(),
        seq=seq,
        metrics_json=f'{{"temp": {20.5 + seq}}}',
        events_json=None,
    )


def at(day: date, hour: int = 12) -> datetime:
    return day_start(day) + timedelta(hours=hour)


async def store(conn: asyncpg.Connection, rows: Sequence[TelemetryRow], node: str = "n1") -> int:
    async with conn.transaction():
        return len(await insert_telemetry(conn, rows, node))


async def partitions(conn: asyncpg.Connection) -> list[date]:
    rows = await conn.fetch(
        "SELECT to_date(substr(c.relname, 12), 'YYYYMMDD') AS day FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'telemetry'::regclass "
        "AND c.relname ~ '^telemetry_p' ORDER BY 1"
    )
    return [r["day"] for r in rows]


async def where_stored(conn: asyncpg.Connection, event_id: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT tableoid::regclass::text AS part FROM telemetry WHERE event_id = $1", event_id
    )
    return [r["part"] for r in rows]


def sample_value(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name}{labels}"
    return value


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def runner(
    pool: asyncpg.Pool, clock: Clock, metrics: Metrics | None = None, **retention: int
) -> Maintenance:
    return Maintenance(
        pool=pool,
        retention=RetentionConfig(**retention),  # type: ignore[arg-type]  # test keywords
        metrics=metrics or Metrics(),
        db_clock=clock,
        chunk_rows=3,
        default_partition_pages=1,
    )


@pytest.fixture
async def second_pool(db_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """Another node's pool on the same database."""
    pool = await create_pool(db_dsn, min_size=1, max_size=2, application_name="node-2")
    try:
        yield pool
    finally:
        await pool.close()


async def test_partitions_are_created_ahead_and_pick_up_rows_waiting_in_the_default(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    later = TODAY + timedelta(days=60)
    early = sample("dev-1", at(later + timedelta(days=2)), 1)  # no partition for it yet
    assert await store(db, [early]) == 1
    assert await where_stored(db, early.event_id) == ["telemetry_default"]

    clock = Clock(at(later, 3))
    report = await runner(pool, clock, partitions_ahead_days=5).run_once()

    assert report.ran
    assert report.created == [later + timedelta(days=n) for n in range(6)]
    assert set(report.created) <= set(await partitions(db))
    # The waiting row moved into its day's partition, once, and a redelivery is refused there.
    assert await where_stored(db, early.event_id) == [
        f"telemetry_p{(later + timedelta(days=2)):%Y%m%d}"
    ]
    assert await store(db, [early]) == 0
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 1
    # A second pass finds everything there.
    assert (await runner(pool, clock, partitions_ahead_days=5).run_once()).created == []


async def test_days_older_than_the_window_are_dropped_and_the_rest_kept(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    start = TODAY + timedelta(days=100)
    clock = Clock(at(start, 0))
    await runner(pool, clock, partitions_ahead_days=9).run_once()
    rows = [sample("dev-1", at(start + timedelta(days=n)), n) for n in range(10)]
    stale = sample("dev-2", at(start + timedelta(days=1), 5), 99)
    # A row in the default partition older than the window goes too; a recent one stays.
    await db.execute(
        "SELECT telemetry_drop_day_partition($1::date, 'infinity')", start + timedelta(days=1)
    )
    assert await store(db, [*rows, stale]) == 11
    assert await where_stored(db, stale.event_id) == ["telemetry_default"]

    # 30 days kept; at day start+35 12:00, the oldest day kept is start+5.
    clock.now = at(start + timedelta(days=35))
    metrics = Metrics()
    report = await runner(pool, clock, metrics, telemetry_days=30).run_once()

    assert report.dropped == [
        start,
        start + timedelta(days=2),
        *(start + timedelta(days=n) for n in range(3, 5)),
    ]
    assert report.deleted["telemetry_default"] == 2  # rows[1] and stale
    kept = await db.fetch("SELECT seq FROM telemetry ORDER BY seq")
    assert [r["seq"] for r in kept] == [5, 6, 7, 8, 9]
    assert start + timedelta(days=4) not in await partitions(db)
    assert start + timedelta(days=5) in await partitions(db)
    assert sample_value(metrics, "gateway_telemetry_oldest_day_timestamp_seconds") == (
        day_start(start + timedelta(days=5)).timestamp()
    )


async def test_the_same_event_twice_through_two_nodes_is_stored_once(
    pool: asyncpg.Pool, second_pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """Today's partition, a day far in the past and one far in the future (default partition):
    two nodes write the same batch at the same moment, each event is stored once."""
    batch = [
        sample("dev-1", NOW, 1),
        sample("dev-1", datetime(1999, 12, 31, 23, 59, tzinfo=UTC), 2),
        sample("dev-1", datetime(2200, 1, 1, tzinfo=UTC), 3),
        sample("dev-2", datetime(1970, 1, 1, tzinfo=UTC), 4),
    ]
    ready = asyncio.Barrier(3)

    async def node(p: asyncpg.Pool, node_id: str) -> int:
        async with p.acquire() as conn:
            await ready.wait()  # both connections held: released together
            return await store(conn, batch, node_id)

    tasks = [asyncio.create_task(node(pool, "n1")), asyncio.create_task(node(second_pool, "n2"))]
    await ready.wait()
    stored = await asyncio.gather(*tasks)

    assert sum(stored) == 4
    rows = await db.fetch("SELECT event_id, count(*) AS n FROM telemetry GROUP BY event_id")
    assert {r["event_id"]: r["n"] for r in rows} == {s.event_id: 1 for s in batch}
    assert await where_stored(db, batch[0].event_id) == [f"telemetry_p{TODAY:%Y%m%d}"]
    for far in batch[1:]:
        assert await where_stored(db, far.event_id) == ["telemetry_default"]
    # And again later, one node at a time: still refused.
    assert await store(db, batch, "n3") == 0


async def test_a_sample_is_kept_the_window_after_it_arrived_whatever_its_device_time(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """A device clock 40 days behind (or a store-and-forward upload) dates fresh samples into
    a day past the window. They stay until the window has passed since they arrived: the day's
    partition is dropped with what was received long ago, and the fresh rows move to the
    default partition, pruned by receipt time."""
    day = TODAY - timedelta(days=40)
    await db.execute("SELECT telemetry_add_day_partition($1::date)", day)
    long_ago = sample("dev-1", at(day), 1)
    fresh = sample("dev-2", at(day, 13), 2)  # arrives now, dated 40 days back
    assert await store(db, [long_ago, fresh]) == 2
    await db.execute(
        "UPDATE telemetry SET received_at = $2 WHERE event_id = $1",
        long_ago.event_id,
        at(day, 12),
    )

    clock = Clock(NOW)
    report = await runner(pool, clock, telemetry_days=30).run_once()
    assert day in report.dropped
    assert await where_stored(db, fresh.event_id) == ["telemetry_default"]
    assert await where_stored(db, long_ago.event_id) == []
    assert await store(db, [fresh]) == 0  # still remembered: a redelivery is a duplicate
    # Another pass inside the window keeps it; the first pass past it deletes it.
    assert (await runner(pool, clock, telemetry_days=30).run_once()).deleted[
        "telemetry_default"
    ] == 0
    clock.now = NOW + timedelta(days=31)
    report = await runner(pool, clock, telemetry_days=30).run_once()
    assert report.deleted["telemetry_default"] == 1
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 0


async def test_a_sample_dated_far_ahead_is_pruned_the_window_after_it_arrived(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """A clock years ahead puts samples in the default partition; they do not stay there
    until that time comes."""
    ahead = sample("dev-1", datetime(2090, 1, 1, tzinfo=UTC), 1)
    assert await store(db, [ahead]) == 1
    assert await where_stored(db, ahead.event_id) == ["telemetry_default"]
    clock = Clock(NOW + timedelta(days=29))
    assert (await runner(pool, clock, telemetry_days=30).run_once()).deleted[
        "telemetry_default"
    ] == 0
    clock.now = NOW + timedelta(days=31)
    assert (await runner(pool, clock, telemetry_days=30).run_once()).deleted[
        "telemetry_default"
    ] == 1


async def test_keep_forever_drops_nothing(pool: asyncpg.Pool, db: asyncpg.Connection) -> None:
    old = sample("dev-1", datetime(2001, 1, 1, tzinfo=UTC), 1)
    await db.execute("SELECT telemetry_add_day_partition('2001-01-01')")
    assert await store(db, [old, sample("dev-1", datetime(1980, 1, 1, tzinfo=UTC), 2)]) == 2
    report = await runner(pool, Clock(NOW), telemetry_days=0).run_once()
    assert report.dropped == []
    assert "telemetry_default" not in report.deleted
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 2


async def test_the_pass_samples_table_sizes_and_the_oldest_day(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    rows = [sample(f"dev-{n % 7}", NOW - timedelta(minutes=n), n) for n in range(500)]
    rows.append(sample("dev-9", datetime(2003, 3, 3, 3, tzinfo=UTC), 1000))
    assert await store(db, rows) == 501
    await db.execute("ANALYZE telemetry")  # and each of its partitions
    metrics = Metrics()
    await runner(pool, Clock(NOW), metrics, telemetry_days=0).run_once()

    assert sample_value(metrics, "gateway_table_rows", table="telemetry") == 501
    assert sample_value(metrics, "gateway_table_bytes", table="telemetry") > 0
    for table in MEASURED_TABLES:  # every table has its two series, empty or not
        assert sample_value(metrics, "gateway_table_rows", table=table) >= 0
        assert sample_value(metrics, "gateway_table_bytes", table=table) >= 0
    assert sample_value(metrics, "gateway_telemetry_oldest_day_timestamp_seconds") == (
        datetime(2003, 3, 3, tzinfo=UTC).timestamp()
    )
    text = metrics.render()[0].decode()
    assert 'gateway_table_bytes{table="dead_letter"}' in text
    assert "gateway_telemetry_oldest_day_timestamp_seconds 1.0466496e+09" in text


async def test_a_partition_made_while_its_event_is_being_stored_keeps_it_once(
    pool: asyncpg.Pool, second_pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """Forced interleaving: node 1 has stored an event of a future day (default partition) and
    not committed; the pass that makes that day's partition waits for it; node 2's copy of the
    same event waits behind the pass. Node 1 commits, the pass moves the row, node 2's copy is
    then routed to the new partition and refused there."""
    day = TODAY + timedelta(days=40)
    event = sample("dev-1", at(day), 1)
    first = await asyncpg.connect(db_dsn)
    try:
        writing = first.transaction()
        await writing.start()
        assert len(await insert_telemetry(first, [event], "n1")) == 1

        clock = Clock(at(day - timedelta(days=2)))
        maintenance = asyncio.create_task(runner(pool, clock, partitions_ahead_days=3).run_once())
        await wait_for_lock_waiters(db, 1)

        async def second_copy() -> int:
            async with second_pool.acquire() as conn:
                return await store(conn, [event], "n2")

        copy = asyncio.create_task(second_copy())
        await wait_for_lock_waiters(db, 2)
        await writing.commit()

        report = await maintenance
        assert day in report.created
        assert await copy == 0
    finally:
        await first.close()
    assert await where_stored(db, event.event_id) == [f"telemetry_p{day:%Y%m%d}"]


async def wait_for_lock_waiters(db: asyncpg.Connection, n: int) -> None:
    """Until ``n`` sessions wait for a lock on this database's telemetry table (pg_locks spans
    the cluster, and databases cloned from one template share the table's oid)."""

    async def waiting() -> bool:
        count = await db.fetchval(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'telemetry'::regclass"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return bool(count >= n)

    await wait_until(waiting, timeout=20, message=f"{n} sessions wait on telemetry")


async def test_a_long_reader_defers_partition_changes_and_the_rest_of_the_pass_goes_on(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    old_day = TODAY - timedelta(days=40)
    new_day = TODAY + timedelta(days=60)
    await db.execute("SELECT telemetry_add_day_partition($1::date)", old_day)
    await db.execute(
        "INSERT INTO dead_letter (topic, payload, payload_size, payload_sha256, reason, detail, "
        "node_id, received_at, last_seen_at) VALUES ('t', 'x', 1, encode(sha256('x'), 'hex'), "
        "'INVALID', 'bad', 'n1', now() - interval '40 days', now() - interval '40 days')"
    )
    clock = Clock(at(new_day - timedelta(days=1)))

    def maintenance() -> Maintenance:
        return Maintenance(
            pool=pool,
            retention=RetentionConfig(telemetry_days=30, partitions_ahead_days=1),
            metrics=Metrics(),
            db_clock=clock,
            partition_lock_timeout="200ms",
        )

    reader = await asyncpg.connect(db_dsn)
    try:
        reading = reader.transaction()
        await reading.start()
        await reader.fetchval("SELECT count(*) FROM telemetry")  # holds its locks until the end
        report = await maintenance().run_once()
        assert report.created == []  # both days of the window deferred ...
        assert report.dropped == []
        assert report.deleted["dead_letter"] == 1  # ... and the rest done
        await reading.rollback()
    finally:
        await reader.close()
    report = await maintenance().run_once()
    assert report.created == [new_day - timedelta(days=1), new_day]
    assert old_day in report.dropped


@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin", "Asia/Kathmandu"])
async def test_samples_either_side_of_midnight_utc_land_in_their_day_partitions(
    db_dsn: str, db: asyncpg.Connection, zone: str
) -> None:
    """A node started at 23:59:58 UTC, its database sessions in any time zone (+05:45 puts
    local midnight nowhere near UTC's): its first pass makes today's and tomorrow's
    partitions, as UTC days, and the samples of 23:59:59.999, 00:00:00.001 and of a clock
    ahead within max_future_skew_s land in their days' partitions, none in the default."""
    day = TODAY + timedelta(days=120)  # a day no partition exists for yet
    midnight = day_start(day)
    # The embedded server's DSN has a query already (its socket directory).
    joined = "&" if "?" in db_dsn else "?"
    node = await create_pool(f"{db_dsn}{joined}TimeZone={zone}", min_size=1, max_size=2)
    try:
        async with node.acquire() as conn:
            assert await conn.fetchval("SHOW TimeZone") == zone
        report = await runner(
            node, Clock(midnight - timedelta(seconds=2)), partitions_ahead_days=1
        ).run_once()
        assert report.created == [day - timedelta(days=1), day]
        rows = [
            sample("dev-1", midnight - timedelta(milliseconds=1), 1),
            sample("dev-1", midnight + timedelta(milliseconds=1), 2),
            sample("dev-1", midnight + timedelta(seconds=299), 3),  # a clock ahead
        ]
        async with node.acquire() as conn:
            assert await store(conn, rows) == 3
    finally:
        await node.close()
    assert [await where_stored(db, row.event_id) for row in rows] == [
        [f"telemetry_p{day - timedelta(days=1):%Y%m%d}"],
        [f"telemetry_p{day:%Y%m%d}"],
        [f"telemetry_p{day:%Y%m%d}"],
    ]


async def test_a_day_dropped_while_a_batch_writes_into_it_keeps_the_batch(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """Forced interleaving: a node's batch stores a sample of a day past the window (a clock
    40 days behind) and has not committed; the pass that drops that day waits for it, then
    drops the day with what was received long ago and keeps the batch's fresh sample (in the
    default partition), once."""
    day = TODAY - timedelta(days=40)
    await db.execute("SELECT telemetry_add_day_partition($1::date)", day)
    fresh = sample("dev-1", at(day, 23), 1)
    writer = await asyncpg.connect(db_dsn)
    try:
        batch = writer.transaction()
        await batch.start()
        assert len(await insert_telemetry(writer, [fresh], "n1")) == 1
        maintenance = Maintenance(
            pool=pool,
            retention=RetentionConfig(telemetry_days=30, partitions_ahead_days=1),
            metrics=Metrics(),
            db_clock=Clock(NOW),
            partition_lock_timeout="60s",
        )
        dropping = asyncio.create_task(maintenance.run_once())
        await wait_for_lock_waiters(db, 1)
        await batch.commit()
        report = await dropping
    finally:
        await writer.close()
    assert day in report.dropped
    assert await where_stored(db, fresh.event_id) == ["telemetry_default"]
    assert await store(db, [fresh]) == 0  # a redelivery is still a duplicate
