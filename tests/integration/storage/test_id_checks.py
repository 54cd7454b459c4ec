"""The checks on ids (migration 0035) refuse exactly what their first form refused, in every
telemetry partition, on a database migrated from scratch and on one upgraded with rows in it."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import asyncpg

from storage.migrate import migrate
from tests.support.schema import schema_before, version_of

NOW = datetime.now(UTC)
HEX = "0123456789abcdef" * 4
CHECKS = version_of("checks_without_bounded_repeats")

# What the checks said before migration 0035, as Python says it (fullmatch: no trailing newline,
# as PostgreSQL's `$` allows none).
OLD_HEX = re.compile(r"[0-9a-f]{64}")
OLD_COMMAND_DEVICE = re.compile(r"[A-Za-z0-9_.:-]{1,64}(/[A-Za-z0-9_.:-]{1,64}){0,2}")

HEX_CANDIDATES = [
    HEX,
    HEX.upper(),
    HEX[:63],
    HEX + "0",
    HEX[:63] + "g",
    HEX[:63] + "\n",  # 64 bytes; `$` before a newline would let it pass
    HEX + "\n",
    "\n" + HEX[:63],
    HEX[:62] + "é",  # 64 bytes, 63 characters
    HEX[:62] + "٣",  # an Arabic-Indic digit: a digit, not one of [0-9]
    " " + HEX[:63],
    "",
]
DEVICE_CANDIDATES = [
    "dev-1",
    "d" * 64,
    "d" * 65,
    "g/n",
    "g/n/d",
    "g/" + "n" * 64,
    "g/" + "n" * 65,
    "g/n/" + "d" * 65,
    "g" * 65 + "/n",
    "a" * 64 + "/" + "b" * 64 + "/" + "c" * 64,
    "a/b/c/d",
    "a//b",
    "/a",
    "a/",
    "",
    "dev-1\n",
    "dev 1",
    "dév",
]


async def _accepted(conn: asyncpg.Connection, sql: str, *args: object) -> bool:
    try:
        async with conn.transaction():
            await conn.execute(sql, *args)
    except asyncpg.CheckViolationError:
        return False
    return True


async def _telemetry_accepted(conn: asyncpg.Connection, event_id: str, ts: datetime) -> bool:
    return await _accepted(
        conn,
        "INSERT INTO telemetry (event_id, device_id, ts, node_id) VALUES ($1, 'dev-1', $2, 'n')",
        event_id,
        ts,
    )


async def _every_check_as_before(conn: asyncpg.Connection) -> None:
    # Today's partition, a partition added after the migration, and the default one.
    assert await conn.fetchval("SELECT telemetry_add_day_partition($1)", NOW.date() + timedelta(30))
    for ts in (NOW, NOW + timedelta(days=30, hours=1), datetime(2001, 1, 1, tzinfo=UTC)):
        for n, candidate in enumerate(HEX_CANDIDATES):
            accepted = await _telemetry_accepted(conn, candidate, ts + timedelta(seconds=n))
            assert accepted is bool(OLD_HEX.fullmatch(candidate)), (candidate, ts)
    for candidate in HEX_CANDIDATES:
        accepted = await _accepted(
            conn,
            "INSERT INTO dead_letter (topic, payload, payload_size, payload_sha256, reason, "
            "detail, node_id) VALUES ('t/' || md5($1), 'x', 1, $1, 'INVALID', 'd', 'n')",
            candidate,
        )
        assert accepted is bool(OLD_HEX.fullmatch(candidate)), candidate
    for candidate in DEVICE_CANDIDATES:
        accepted = await _accepted(
            conn, "INSERT INTO command (device_id, name) VALUES ($1, 'reboot')", candidate
        )
        assert accepted is bool(OLD_COMMAND_DEVICE.fullmatch(candidate)), candidate
    # No partition kept the old form; every one holds the new check, inherited.
    rows = await conn.fetch(
        "SELECT c.conrelid::regclass::text AS part, pg_get_constraintdef(c.oid) AS def, "
        "c.conislocal FROM pg_inherits i JOIN pg_constraint c ON c.conrelid = i.inhrelid "
        "WHERE i.inhparent = 'telemetry'::regclass AND c.contype = 'c'"
    )
    parts = await conn.fetchval(
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'telemetry'::regclass"
    )
    assert len(rows) == parts > 2
    assert all("{64}" not in r["def"] and "octet_length" in r["def"] for r in rows)
    assert not any(r["conislocal"] for r in rows)
    assert not await conn.fetch(
        "SELECT conname FROM pg_constraint WHERE pg_get_constraintdef(oid) ~ '\\{[0-9]*,?64\\}'"
    )


async def test_the_id_checks_refuse_what_they_refused_before(db: asyncpg.Connection) -> None:
    await _every_check_as_before(db)


async def test_an_upgraded_database_keeps_its_rows_and_loses_every_costly_check(
    empty_db_dsn: str,
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await schema_before(conn, CHECKS)
        # Rows in two days before, today, and a day ahead: four partitions and the default.
        await conn.execute(
            """
            INSERT INTO telemetry (event_id, device_id, ts, node_id)
            SELECT encode(sha256(int8send(g)), 'hex'), 'dev-1',
                   $1::timestamptz - make_interval(hours => g), 'n'
            FROM generate_series(-30, 48) AS g
            UNION ALL
            SELECT encode(sha256(int8send(-1000)), 'hex'), 'dev-far', '2001-01-01', 'n'
            """,
            NOW,
        )
        before = await conn.fetch("SELECT * FROM telemetry ORDER BY event_id")

        assert CHECKS in await migrate(conn)

        after = await conn.fetch("SELECT * FROM telemetry ORDER BY event_id")
        assert [tuple(r) for r in after] == [tuple(r) for r in before]
        await _every_check_as_before(conn)
    finally:
        await conn.close()
