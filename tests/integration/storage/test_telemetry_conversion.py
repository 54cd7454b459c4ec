"""The retention migration converts an installation's telemetry table into day partitions,
keeping every row; ingest's dedup then holds for the rows that were there before."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from protocol import micros
from storage.ingest import TelemetryRow, insert_telemetry
from storage.migrate import migrate
from tests.support.schema import schema_before, version_of

RETENTION = version_of("retention")
NOW = datetime.now(UTC)


async def test_a_populated_table_is_converted_with_every_row(empty_db_dsn: str) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        # The schema as it was before the retention migration, with a year of rows, rows of
        # a device clock far off, and rows from the future.
        await schema_before(conn, RETENTION)
        await conn.execute(
            """
            INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, events, received_at,
                                   node_id)
            SELECT encode(sha256(int8send(g)), 'hex'), 'dev-' || (g % 5),
                   $1::timestamptz - make_interval(hours => g), g,
                   jsonb_build_object('temp', g),
                   CASE WHEN g % 3 = 0 THEN '[{"type": "X"}]'::jsonb END,
                   $1::timestamptz - make_interval(hours => g) + interval '1 second', 'n' || g % 2
            FROM generate_series(-100, 9000) AS g
            UNION ALL
            SELECT encode(sha256(int8send(-1000 - g)), 'hex'), 'dev-far', t, NULL, NULL,
                   '[]'::jsonb, t, 'n1'
            FROM (VALUES (1, '1970-01-01T00:00:00Z'::timestamptz),
                         (2, '2009-02-13T23:31:30Z'), (3, '9999-12-31T23:59:59.999Z')) AS v(g, t)
            """,
            NOW,
        )
        before = await conn.fetch("SELECT * FROM telemetry ORDER BY event_id")

        assert RETENTION in await migrate(conn)

        after = await conn.fetch("SELECT * FROM telemetry ORDER BY event_id")
        assert [tuple(r) for r in after] == [tuple(r) for r in before]
        assert await conn.fetchval(
            "SELECT relkind::text FROM pg_class WHERE relname = 'telemetry'"
        ) == ("p")
        assert await conn.fetchval("SELECT to_regclass('telemetry_unpartitioned')") is None
        # A partition per day of the last year that had rows, and today and a week ahead; the
        # rest waits in the default partition.
        days = {
            r["day"]
            for r in await conn.fetch(
                "SELECT to_date(substr(c.relname, 12), 'YYYYMMDD') AS day FROM pg_inherits i "
                "JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = 'telemetry'::regclass AND c.relname ~ '^telemetry_p'"
            )
        }
        today = NOW.date()
        assert {today + timedelta(days=n) for n in range(8)} <= days
        assert today - timedelta(days=365) in days
        assert today - timedelta(days=375) not in days
        in_default = await conn.fetchval(
            "SELECT count(*) FROM telemetry_default WHERE ts < $1", NOW - timedelta(days=367)
        )
        assert in_default == await conn.fetchval(
            "SELECT count(*) FROM telemetry WHERE ts < $1", NOW - timedelta(days=367)
        )
        assert in_default > 0
        assert (
            await conn.fetchval("SELECT count(*) FROM ONLY telemetry_default WHERE ts > $1", NOW)
            == 1  # 9999-12-31 only: the rows of the next hours are in today's partitions
        )
        # Migrated to the last: the key migration 0036 gave it, the time first.
        assert await conn.fetchval(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'telemetry_pkey'"
        ) == ("PRIMARY KEY (ts, event_id)")

        # The ingest statement refuses the rows that were there before (exactly once holds
        # across the conversion), wherever they now live, and stores a new one.
        old = [
            TelemetryRow(r["event_id"], r["device_id"], micros(r["ts"]), r["seq"], None, None)
            for r in before[:: len(before) // 50]
        ]
        new = TelemetryRow("f" * 64, "dev-1", micros(NOW), 1, '{"temp": 1}', None)
        async with conn.transaction():
            stored = await insert_telemetry(conn, [*old, new], "n9")
        assert stored == {new.event_id}
    finally:
        await conn.close()


@pytest.mark.skipif(
    not os.environ.get("CONVERSION_ROWS"), reason="run by hand: CONVERSION_ROWS=1000000"
)
async def test_conversion_time_by_hand(empty_db_dsn: str) -> None:
    """Time the retention migration on CONVERSION_ROWS rows spread over 30 days (five devices,
    two metrics, an event on every third); prints the seconds and the table's size."""
    rows = int(os.environ["CONVERSION_ROWS"])
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await schema_before(conn, RETENTION)
        await conn.execute(
            """
            INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, events, received_at,
                                   node_id)
            SELECT encode(sha256(int8send(g)), 'hex'), 'dev-' || (g % 5),
                   $1::timestamptz - make_interval(secs => g * (2592000.0 / $2)), g,
                   jsonb_build_object('temp', g % 100, 'humidity', g % 70),
                   CASE WHEN g % 3 = 0 THEN '[{"type": "DOOR_OPEN"}]'::jsonb END,
                   $1::timestamptz, 'n' || g % 2
            FROM generate_series(1, $2) AS g
            """,
            NOW,
            rows,
        )
        await conn.execute("VACUUM ANALYZE telemetry")
        size = await conn.fetchval("SELECT pg_size_pretty(pg_total_relation_size('telemetry'))")
        started = time.perf_counter()
        assert RETENTION in await migrate(conn)
        elapsed = time.perf_counter() - started
        assert await conn.fetchval("SELECT count(*) FROM telemetry") == rows
        print(f"\n{rows:,} rows ({size}) converted in {elapsed:.1f} s")
    finally:
        await conn.close()
