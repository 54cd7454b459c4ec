"""Migrations, named SQL blocks and the ingest repository against real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import asyncpg
import msgspec
import pytest

from protocol import Telemetry, micros
from storage import ingest as repo
from storage.errors import MigrationChecksumError, SchemaTooNewError
from storage.ingest import DeadLetterRow, TelemetryRow
from storage.migrate import (
    EARLIER_CHECKSUMS,
    latest_version,
    migrate,
    schema_version,
    shipped_migrations,
)
from storage.sql import load_queries, query_files


async def test_migrations_apply_to_an_empty_database_and_are_idempotent(
    empty_db_dsn: str,
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        assert await schema_version(conn) == 0
        assert await migrate(conn) == [m.version for m in shipped_migrations()]
        assert await migrate(conn) == []
        assert await schema_version(conn) == latest_version()
        tables = {
            r["tablename"]
            for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname='public'")
        }
        assert {"device", "telemetry", "dead_letter", "schema_migration"} <= tables
        recorded = await conn.fetch("SELECT version, name, checksum FROM schema_migration")
        assert [(r["version"], r["name"]) for r in recorded] == [
            (m.version, m.name) for m in shipped_migrations()
        ]
    finally:
        await conn.close()


async def test_nodes_starting_at_once_migrate_exactly_once(empty_db_dsn: str) -> None:
    conns = [await asyncpg.connect(empty_db_dsn) for _ in range(5)]
    gate = asyncio.Event()

    async def node(conn: asyncpg.Connection) -> list[int]:
        await gate.wait()
        return await migrate(conn)

    try:
        tasks = [asyncio.create_task(node(c)) for c in conns]
        gate.set()
        results = await asyncio.gather(*tasks)
    finally:
        for conn in conns:
            await conn.close()
    applied = [r for r in results if r]
    assert applied == [[m.version for m in shipped_migrations()]]


async def test_an_older_release_refuses_a_newer_schema(db: asyncpg.Connection) -> None:
    await db.execute(
        "INSERT INTO schema_migration (version, name, checksum) VALUES ($1, 'future', 'x')",
        latest_version() + 1,
    )
    with pytest.raises(SchemaTooNewError) as caught:
        await migrate(db)
    assert caught.value.database_version == latest_version() + 1
    assert "refusing to start" in str(caught.value)


async def test_a_database_recorded_before_the_comments_changed_still_migrates(
    db: asyncpg.Connection,
) -> None:
    for version, earlier in EARLIER_CHECKSUMS.items():
        (checksum,) = earlier
        await db.execute(
            "UPDATE schema_migration SET checksum = $2 WHERE version = $1", version, checksum
        )
    assert await migrate(db) == []
    # Any other checksum for those versions is still an edit.
    await db.execute("UPDATE schema_migration SET checksum = 'edited' WHERE version = 2")
    with pytest.raises(MigrationChecksumError):
        await migrate(db)


async def test_an_edited_migration_is_detected(db: asyncpg.Connection) -> None:
    await db.execute("UPDATE schema_migration SET checksum = 'edited' WHERE version = 1")
    with pytest.raises(MigrationChecksumError):
        await migrate(db)


async def test_every_named_block_prepares_against_the_schema(db: asyncpg.Connection) -> None:
    for filename in query_files():
        queries = load_queries(filename)
        for name in queries.names():
            if filename == "migrations.sql":
                continue  # DDL and lock calls: exercised by the migration tests
            await db.prepare(queries[name])


def _row(event_id: str, device: str = "dev-1", seq: int = 0) -> TelemetryRow:
    return TelemetryRow(
        event_id,
        device,
        Telemetry(ts=datetime(2026, 1, 1, tzinfo=UTC), seq=seq, metrics={"temp": 1}).micros(),
        seq,
        '{"temp": 1}',
        None,
    )


@pytest.mark.parametrize(
    "ts",
    [
        0,
        1_767_225_600_123,
        253_370_764_799_999,  # the last millisecond a device time may take
        datetime(2026, 12, 3, 18, 30, 1, 123457, tzinfo=UTC),
        datetime(9998, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ],
)
async def test_a_stored_time_is_the_message_time_to_the_microsecond(
    db: asyncpg.Connection, ts: int | datetime
) -> None:
    """Rows travel with their time as microseconds (telemetry_write_us); the statement turns
    it back exactly, over a device time's whole range (a float8 of microseconds would not)."""
    message = Telemetry(ts=ts, seq=1, metrics={"temp": 1})
    row = TelemetryRow("e" * 64, "dev-1", message.micros(), 1, '{"temp": 1}', None)
    async with db.transaction():
        assert await repo.insert_telemetry(db, [row], "n1") == {row.event_id}
    assert await db.fetchval("SELECT ts FROM telemetry") == message.timestamp()


@pytest.mark.parametrize(
    ("seqs", "metrics", "events"),
    [
        ([None], [None], [None]),  # one row, every nullable column NULL: an empty text each
        ([7], [{"t": 1}], [None]),
        ([None, None, None], [None, None, None], [None, None, None]),
        ([1, None, 3], [{"a": 1}, None, {"b": 2}], [None, ["X"], None]),
        ([None, None, 0], [None, None, {"z": 0}], [["A"], None, None]),  # NULLs first
    ],
)
async def test_rows_travel_as_columns_of_lines_and_come_back_whole(
    db: asyncpg.Connection,
    seqs: list[int | None],
    metrics: list[dict[str, object] | None],
    events: list[list[str] | None],
) -> None:
    """The rows go as one text of lines a column, an empty line standing for NULL: every
    column lands on its own row whatever is NULL where, and JSON whose strings hold newlines,
    tabs, quotes and backslashes (escaped by the encoder, as the decoder's rows are) is
    stored as it was."""
    awkward = {"line\nbreak": 'a\nb\tc "q" \\ é', "n": 1.5}
    sent = [
        TelemetryRow(
            f"{n:064x}",
            f"dev-{n}",
            1_767_225_600_000_000 + n,
            seq,
            None if m is None else msgspec.json.encode({**m, **awkward}).decode(),
            None if e is None else msgspec.json.encode(e).decode(),
        )
        for n, (seq, m, e) in enumerate(zip(seqs, metrics, events, strict=True))
    ]
    async with db.transaction():
        new = await repo.insert_telemetry(db, sent, "n1")
    assert new == {r.event_id for r in sent}
    stored = {
        r["event_id"]: r
        for r in await db.fetch(
            "SELECT event_id, device_id, ts, seq, metrics::text AS m, events::text AS e,"
            " node_id FROM telemetry"
        )
    }
    assert len(stored) == len(sent)
    for row, seq, m, e in zip(sent, seqs, metrics, events, strict=True):
        got = stored[row.event_id]
        assert got["device_id"] == row.device_id
        assert micros(got["ts"]) == row.ts_us
        assert got["seq"] == seq
        assert (None if got["m"] is None else json.loads(got["m"])) == (
            None if m is None else {**m, **awkward}
        )
        assert (None if got["e"] is None else json.loads(got["e"])) == e
        assert got["node_id"] == "n1"


async def test_insert_reports_only_new_event_ids(db: asyncpg.Connection) -> None:
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    async with db.transaction():
        assert await repo.insert_telemetry(db, [_row(a), _row(b), _row(a)], "n1") == {a, b}
    async with db.transaction():
        assert await repo.insert_telemetry(db, [_row(b), _row(c)], "n1") == {c}
    assert await repo.count_telemetry(db) == 3


async def test_devices_are_registered_on_first_sight_and_touched_after(
    db: asyncpg.Connection,
) -> None:
    await repo.touch_devices(db, {"dev-1", "dev-2"})
    first = await db.fetchrow("SELECT first_seen, last_seen FROM device WHERE device_id='dev-1'")
    await repo.touch_devices(db, {"dev-1"})
    second = await db.fetchrow("SELECT first_seen, last_seen FROM device WHERE device_id='dev-1'")
    assert second["first_seen"] == first["first_seen"]
    assert second["last_seen"] >= first["last_seen"]
    await repo.record_presence(db, {"dev-1": "offline", "dev-3": "online"})
    rows = dict(await db.fetch("SELECT device_id, presence FROM device ORDER BY device_id"))
    assert rows == {"dev-1": "offline", "dev-2": "unknown", "dev-3": "online"}


async def test_dead_letters_keep_raw_bytes_and_can_be_listed_by_reason(
    db: asyncpg.Connection,
) -> None:
    raw = bytes(range(256))
    await repo.insert_dead_letters(
        db,
        [
            DeadLetterRow.whole("iot/devices/x/telemetry", raw, "MALFORMED", "not JSON"),
            DeadLetterRow.whole("iot/x", b"{}", "BAD_TOPIC", "no"),
        ],
        "n1",
    )
    letters = await repo.list_dead_letters(db, reason="MALFORMED")
    assert len(letters) == 1
    assert letters[0].payload == raw
    assert letters[0].node_id == "n1"
    assert [d.reason for d in await repo.list_dead_letters(db)] == ["MALFORMED", "BAD_TOPIC"]
    assert await repo.list_dead_letters(db, after_id=letters[0].id, limit=10) == (
        await repo.list_dead_letters(db, reason="BAD_TOPIC")
    )


async def test_last_seen_moves_by_the_second_but_always_past_an_offline_presence(
    db: asyncpg.Connection,
) -> None:
    await repo.touch_devices(db, {"dev-ls"})
    first = await db.fetchval("SELECT last_seen FROM device WHERE device_id = 'dev-ls'")
    await repo.touch_devices(db, {"dev-ls"})  # within the second: no new row version
    assert await db.fetchval("SELECT last_seen FROM device WHERE device_id = 'dev-ls'") == first
    await repo.record_presence(db, {"dev-ls": "offline"})  # the LWT
    await repo.touch_devices(db, {"dev-ls"})  # then a message: the device is back
    row = await db.fetchrow("SELECT last_seen, presence_at FROM device WHERE device_id = 'dev-ls'")
    assert row is not None
    assert row["last_seen"] > row["presence_at"]
    await db.execute(
        "UPDATE device SET first_seen = first_seen - interval '2 seconds', "
        "last_seen = last_seen - interval '2 seconds', presence_at = NULL, presence = 'unknown'"
    )
    await repo.touch_devices(db, {"dev-ls"})
    assert await db.fetchval("SELECT last_seen FROM device WHERE device_id = 'dev-ls'") > first


async def test_a_device_seen_within_the_second_is_neither_written_nor_locked(
    db: asyncpg.Connection, db_dsn: str
) -> None:
    """A batch's devices were mostly seen a moment ago: touching them writes nothing and takes
    no row lock, so it never waits for another transaction holding the row (a lock would
    cost a WAL record per device per batch)."""
    await repo.touch_devices(db, {"dev-held", "dev-free"})
    before = dict(await db.fetch("SELECT device_id, xmin::text FROM device"))
    holder = await asyncpg.connect(db_dsn)
    try:
        async with holder.transaction():
            await holder.execute("SELECT FROM device WHERE device_id = 'dev-held' FOR UPDATE")
            async with db.transaction():
                await asyncio.wait_for(repo.touch_devices(db, {"dev-held", "dev-free"}), 30)
    finally:
        await holder.close()
    await repo.touch_devices(db, {"dev-free"})
    rows = await db.fetch("SELECT device_id, xmin::text, xmax::text FROM device")
    assert {r["device_id"]: r["xmin"] for r in rows} == before  # no new row version
    assert {r["device_id"]: r["xmax"] for r in rows}["dev-free"] == "0"  # never locked


async def test_touching_devices_never_compares_each_device_with_each_id(
    db: asyncpg.Connection,
) -> None:
    """The statement is prepared once and PostgreSQL soon plans it for any ids (a generic
    plan): there a `device_id = ANY($4)` filter is a linear search of the ids for every row
    scanned (a drain measured 4.5 ms a batch of 500 against 0.4). It joins the ids instead."""
    await repo.touch_devices(db, {f"dev-{n}" for n in range(50)})
    await db.execute("ANALYZE device")
    statement = repo.INSERT_TELEMETRY.rstrip().rstrip(";")
    await db.execute(
        f"PREPARE touch(text, text, text, text, text, text, text, int, text, timestamptz)"
        f" AS {statement}"
    )
    try:
        await db.execute("SET plan_cache_mode = force_generic_plan")
        plan = "\n".join(
            r[0]
            for r in await db.fetch(
                "EXPLAIN EXECUTE touch('', '', '', '', '', '', '', 0, E'dev-1\\ndev-2', NULL)"
            )
        )
    finally:
        await db.execute("RESET plan_cache_mode")
        await db.execute("DEALLOCATE touch")
    assert "ANY" not in plan, plan


async def test_a_repeated_presence_changes_nothing_and_a_change_is_stored(
    db: asyncpg.Connection,
) -> None:
    """The status is retained: every (re)connect of every node reads the last one again."""

    async def stored() -> tuple[str, object]:
        row = await db.fetchrow("SELECT presence, presence_at FROM device WHERE device_id = 'p'")
        assert row is not None
        return row["presence"], row["presence_at"]

    await repo.record_presence(db, {"p": "offline"})
    first = await stored()
    await repo.record_presence(db, {"p": "offline"})  # read again: no new silence
    assert await stored() == first
    await repo.record_presence(db, {"p": "online"})
    back = await stored()
    assert back[0] == "online"
    assert back[1] != first[1]
    await repo.record_presence(db, {"p": "offline"})  # a new offline is a new fact
    gone = await stored()
    assert gone[0] == "offline"
    assert gone[1] != back[1]
