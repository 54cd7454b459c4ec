"""The statement-cut rig (tests/support/pg_cut.py), in front of the real PostgreSQL."""

from __future__ import annotations

import contextlib

import asyncpg
import pytest

from tests.support.dsn import proxy_for, through
from tests.support.pg_cut import PgCut, Statement

# The errors asyncpg raises for a connection reset under it.
LOST = (OSError, asyncpg.exceptions.ConnectionDoesNotExistError, asyncpg.InterfaceError)


async def _refused_once(dsn: str) -> None:
    """A client trying the database again while it is away (what ``outage`` waits for)."""
    with pytest.raises(LOST):
        await asyncpg.connect(dsn, timeout=5)


async def _rows(dsn: str) -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        return [r["n"] for r in await conn.fetch("SELECT n FROM pg_cut_probe ORDER BY n")]
    finally:
        await conn.close()


async def _table(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE TABLE pg_cut_probe (n int PRIMARY KEY)")
    finally:
        await conn.close()


async def test_a_commit_whose_answer_is_cut_has_committed_and_the_client_never_hears_it(
    db_dsn: str,
) -> None:
    await _table(db_dsn)
    proxy = proxy_for(db_dsn)
    await proxy.start()
    cut = PgCut(proxy)
    cut.arm(Statement("INSERT INTO pg_cut_probe", rows=True), Statement("COMMIT"), at="answered")
    try:
        conn = await asyncpg.connect(through(db_dsn, proxy))
        # A statement answering no row, then a COMMIT: not the armed run.
        async with conn.transaction():
            await conn.fetch("INSERT INTO pg_cut_probe SELECT $1 WHERE false RETURNING n", 1)
        with pytest.raises(LOST):
            async with conn.transaction():
                await conn.fetch("INSERT INTO pg_cut_probe VALUES ($1) RETURNING n", 2)
        assert cut.statement == "COMMIT;"
        assert await _rows(db_dsn) == [2]  # committed, the client told nothing
        await _refused_once(through(db_dsn, proxy))
        await cut.outage(timeout=10)
        again = await asyncpg.connect(through(db_dsn, proxy))
        assert await again.fetchval("SELECT count(*) FROM pg_cut_probe") == 1
        await again.close()
        with contextlib.suppress(*LOST):
            await conn.close()
    finally:
        await proxy.stop()


async def test_a_statement_cut_when_sent_never_reaches_the_server(db_dsn: str) -> None:
    await _table(db_dsn)
    proxy = proxy_for(db_dsn)
    await proxy.start()
    cut = PgCut(proxy)
    cut.arm(Statement("INSERT INTO pg_cut_probe"), at="sent")
    try:
        conn = await asyncpg.connect(through(db_dsn, proxy))
        assert await conn.fetchval("SELECT 1") == 1  # prepared and run: passes
        with pytest.raises(LOST):
            await conn.execute("INSERT INTO pg_cut_probe VALUES ($1)", 3)  # extended
        assert cut.statement == "INSERT INTO pg_cut_probe VALUES ($1)"
        assert await _rows(db_dsn) == []
        await _refused_once(through(db_dsn, proxy))
        await cut.outage(timeout=10)
        # Armed again, for a simple Query this time: cut the same way.
        cut.fired.clear()
        cut.arm(Statement("INSERT INTO pg_cut_probe"), at="sent")
        again = await asyncpg.connect(through(db_dsn, proxy))
        with pytest.raises(LOST):
            await again.execute("INSERT INTO pg_cut_probe VALUES (4)")
        assert await _rows(db_dsn) == []
    finally:
        await proxy.stop()
