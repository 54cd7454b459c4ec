"""Migration 0036: telemetry's key leads with the time, on the parent and every partition;
every row stays, ingest's dedup holds for the rows stored before, and the alarms from before
migration 0010 get their sample's time from the one lookup by event id that no index serves
any more."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec
import pytest

from protocol import micros
from storage import alarms as alarm_repo
from storage import rule_runs as runs_repo
from storage.ingest import TelemetryRow, insert_telemetry
from storage.migrate import migrate
from tests.support.schema import schema_before, version_of

KEY_BY_TIME = version_of("telemetry_key_by_time")
NOW = datetime.now(UTC).replace(microsecond=250_000)
FAR_BACK = NOW - timedelta(days=800)  # no partition: the default one


@pytest.fixture(autouse=True)
def _now() -> None:
    """The test's time, taken as it starts: taken at import, a run that crossed midnight UTC
    dated "today's" rows into a day the migrations (run in the test) made no partition for.
    Today's rows go back up to 300 s from it, so in the first minutes of a UTC day it is
    taken a little later in the day (those rows landed in yesterday, which has no partition:
    the default one held 218 rows instead of 100 in a run at 00:05)."""
    global NOW, FAR_BACK  # noqa: PLW0603  # read by the test and its helpers
    now = datetime.now(UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    NOW = max(now, midnight + timedelta(minutes=10)).replace(microsecond=250_000)
    FAR_BACK = NOW - timedelta(days=800)


def _event_id(n: int) -> str:
    return f"{n:064x}"


async def _alarm(
    conn: asyncpg.Connection, alarm_id: int, event_id: str, trigger: dict[str, object] | None
) -> None:
    await conn.execute(
        """
        INSERT INTO alarm (id, device_id, rule_key, severity, status, telemetry_event_id,
                           dedup_key, active_key, triggered_at, trigger, node_id)
        VALUES ($1, 'dev-1', 'door', 'CRITICAL', 'NEW', $2, 'door:dev-1:' || $2, NULL, $3,
                $4::jsonb, 'n1')
        """,
        alarm_id,
        event_id,
        NOW,
        None if trigger is None else msgspec.json.encode(trigger).decode(),
    )


async def _trigger(conn: asyncpg.Connection, alarm_id: int) -> object:
    text = await conn.fetchval("SELECT trigger::text FROM alarm WHERE id = $1", alarm_id)
    return None if text is None else msgspec.json.decode(text)


async def test_the_key_leads_with_the_time_and_old_alarms_get_their_sample_time(
    empty_db_dsn: str,
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await schema_before(conn, KEY_BY_TIME)
        # Rows in today's partition, in the default one (a clock far behind), on two devices.
        await conn.execute(
            """
            INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, node_id)
            SELECT lpad(to_hex(g), 64, '0'), 'dev-' || (g % 2),
                   CASE WHEN g % 3 = 0 THEN $2::timestamptz ELSE $1::timestamptz END
                       - make_interval(secs => g),
                   g, jsonb_build_object('temp', g), 'n1'
            FROM generate_series(1, 300) AS g
            """,
            NOW,
            FAR_BACK,
        )
        before = await conn.fetch("SELECT * FROM telemetry ORDER BY event_id")
        assert await conn.fetchval("SELECT count(*) FROM ONLY telemetry_default") == 100
        sample_of_7 = NOW - timedelta(seconds=7)
        await _alarm(conn, 1, _event_id(7), None)  # before 0010, its sample stored
        await _alarm(conn, 2, _event_id(9_999), None)  # before 0010, its sample pruned
        modern = {"event": "DOOR_OPEN", "sample_ts": (NOW - timedelta(seconds=2)).isoformat()}
        await _alarm(conn, 3, _event_id(2), modern)
        await _alarm(conn, 4, _event_id(8), {"event": "DOOR_OPEN"})  # no time, sample stored

        assert KEY_BY_TIME in await migrate(conn)  # and every later one

        after = await conn.fetch("SELECT * FROM telemetry ORDER BY event_id")
        assert [tuple(r) for r in after] == [tuple(r) for r in before]
        # The parent's key, and each partition's unique index: the time first.
        assert await conn.fetchval(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'telemetry_pkey'"
        ) == ("PRIMARY KEY (ts, event_id)")
        keys = await conn.fetch(
            """
            SELECT c.relname, array_agg(a.attname ORDER BY k.n) AS columns
            FROM pg_inherits i
            JOIN pg_class c ON c.oid = i.inhrelid
            JOIN pg_index x ON x.indrelid = c.oid AND x.indisprimary
            CROSS JOIN LATERAL unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)
            JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
            WHERE i.inhparent = 'telemetry'::regclass
            GROUP BY c.relname
            """
        )
        assert len(keys) >= 9  # the default partition, today and the week ahead
        assert {tuple(r["columns"]) for r in keys} == {("ts", "event_id")}

        # Exactly once across the migration: the rows stored before are refused, wherever they
        # live, and a new one is stored.
        old = [
            TelemetryRow(r["event_id"], r["device_id"], micros(r["ts"]), r["seq"], None, None)
            for r in before[::30]
        ]
        new = TelemetryRow("f" * 64, "dev-1", micros(NOW), 1, '{"temp": 1}', None)
        async with conn.transaction():
            stored = await insert_telemetry(conn, [*old, new], "n9")
        assert stored == {new.event_id}

        # The old alarms: the time of their sample, where it was stored.
        first = await _trigger(conn, 1)
        assert isinstance(first, dict)
        assert first.keys() == {"sample_ts"}
        assert datetime.fromisoformat(str(first["sample_ts"])) == sample_of_7
        assert await _trigger(conn, 2) is None
        assert await _trigger(conn, 3) == modern
        fourth = await _trigger(conn, 4)
        assert isinstance(fourth, dict)
        assert fourth["event"] == "DOOR_OPEN"
        assert datetime.fromisoformat(str(fourth["sample_ts"])) == NOW - timedelta(seconds=8)

        # And the queries that looked the sample up find them by that time now.
        after_rows = await runs_repo.alarms_after(conn, "dev-1", "door", NOW - timedelta(minutes=1))
        assert after_rows == [
            (NOW - timedelta(seconds=8), _event_id(8)),
            (sample_of_7, _event_id(7)),
            (NOW - timedelta(seconds=2), _event_id(2)),
        ]
        cleared = await alarm_repo.clear_raised_by(
            conn, device_id="dev-1", rule_key="door", device_time=NOW - timedelta(seconds=5),
            at=NOW, clear_event_id="clear-1",
        )  # fmt: skip
        assert cleared is not None
        assert cleared["id"] == 1  # raised at -7 s; -2 s came after the clear's time
    finally:
        await conn.close()
