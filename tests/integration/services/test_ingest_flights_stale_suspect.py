"""A suspect that never comes back (a message of a flight acknowledged before a death, which
the broker never delivers again: docs/architecture.md, "Poison messages") must not cost a node
its transactions in flight: only a batch holding a suspect is stored alone.
"""

from __future__ import annotations

import asyncpg

from tests.integration.services.test_ingest_flights import (
    Acks,
    _held_on_dev_a,
    _running,
    _sos,
    _stored,
    _writer,
    conn,  # noqa: F401  (the fixture)
)
from tests.support.waiting import wait_until


async def test_a_suspect_that_never_comes_back_leaves_flights_beside_each_other(
    pool: asyncpg.Pool,
    conn: asyncpg.Connection,  # noqa: F811
    db_dsn: str,
) -> None:
    # Another node died days ago with this message in flight; it was acknowledged by a flight
    # that landed before the death and is never delivered again.
    await conn.execute(
        "INSERT INTO ingest_suspect (digest, deaths, node_id) VALUES ($1, 1, 'node-z')",
        b"\x01" * 16,
    )
    writer, acks = _writer(pool, in_flight=2), Acks()
    async with _running(writer, db_dsn) as locker:
        lock = await _held_on_dev_a(writer, acks, conn, locker)
        await writer.put_many([_sos(acks, "dev-b:1"), _sos(acks, "dev-c:1")])

        async def beside() -> bool:
            return {d for d, _ in await _stored(conn)} >= {"dev-b", "dev-c"}

        try:
            await wait_until(
                beside, timeout=10, message="dev-b and dev-c stored beside the held flight"
            )
        finally:
            await lock.rollback()
        assert await writer.drain(30)
        assert acks.acked == ["dev-a:0", "dev-a:1", "dev-b:1", "dev-c:1"]
