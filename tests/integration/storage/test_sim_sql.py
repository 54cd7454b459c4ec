"""The simulator's SQL blocks parse against the real schema (as ``storage``'s are checked)."""

from __future__ import annotations

import asyncpg
import pytest

from sim.probes import Probes
from sim.sql import blocks

# Several statements in one block: run them, and roll back.
SCRIPTS = {"install_probes", "drop_probes", "checkpoint"}


@pytest.mark.parametrize("filename", ["bench.sql", "naive.sql"])
async def test_every_block_prepares_against_the_migrated_schema(
    db: asyncpg.Connection, filename: str
) -> None:
    found = blocks(filename)
    assert found
    for name, sql in found.items():
        if name in SCRIPTS:
            continue
        await db.prepare(sql)


async def test_the_probes_report_each_commit_and_leave_no_trace(
    db: asyncpg.Connection, db_dsn: str
) -> None:
    stamps: list[list[int]] = []
    async with Probes(db_dsn) as probes:
        probes.on_stamps = lambda values, _seen: stamps.append(values)
        async with db.transaction():  # two statements with equal counts: both are counted
            for first in (10, 20):
                await db.execute(
                    "INSERT INTO telemetry (event_id, device_id, ts, metrics, node_id) "
                    "SELECT repeat(to_hex(g), 64 / length(to_hex(g)) + 1)::char(64), 'd', now(), "
                    "jsonb_build_object('sent_us', g), 'node-a' FROM generate_series($1, $1 + 2) g",
                    first,
                )
        await probes.until(lambda: probes.stored["node-a"] >= 6, timeout_s=10, what="rows")
        assert probes.stored == {"node-a": 6}
        assert sorted(v for chunk in stamps for v in chunk) == [10, 11, 12, 20, 21, 22]
    assert not await db.fetchval("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'bench_%'")


def test_a_block_names_a_file_that_exists() -> None:
    with pytest.raises(FileNotFoundError):
        blocks("missing.sql")


async def test_the_prefill_fills_todays_partition_and_the_old_key_can_be_put_back(
    db: asyncpg.Connection,
) -> None:
    """scripts/hot-path insert --prefill and --event-id-key: rows shaped as the gateway's,
    spread over the span asked for, in the batches' partition (today's here, none in the
    default one), and the key as it was before migration 0036."""
    q = blocks("bench.sql")
    now = await db.fetchval("SELECT date_trunc('day', now(), 'UTC') + interval '12 hours'")
    await db.execute(q["prefill_telemetry"], 3_000, now, 600.0)
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 3_000
    assert await db.fetchval("SELECT count(*) FROM ONLY telemetry_default") == 0
    assert await db.fetchval("SELECT count(DISTINCT device_id) FROM telemetry") == 1_000
    assert await db.fetchval("SELECT bool_and(event_id ~ '^[0-9a-f]{64}$') FROM telemetry")
    span = await db.fetchrow("SELECT min(ts) AS first, max(ts) AS last FROM telemetry")
    assert span["last"] < now
    assert (now - span["first"]).total_seconds() == pytest.approx(600.0)
    await db.execute(q["telemetry_key_by_event_id"])
    assert await db.fetchval(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'telemetry_pkey'"
    ) == ("PRIMARY KEY (event_id, ts)")
