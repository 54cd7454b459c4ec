"""The stream's reads order events by transaction id as a number, not as the text it is sent
as: across a change in the number of digits (999 → 1000, 9999 → 10000) nothing is skipped."""

from __future__ import annotations

import uuid

import asyncpg

from storage import console


async def _xids(db: asyncpg.Connection) -> list[int]:
    """Four transaction ids around the largest power of ten below the horizon (every one of
    them ended, on a server of any age: a fresh embedded cluster is only a few hundred in)."""
    horizon = await console.stream_horizon(db)
    power = 10
    while power * 10 + 1 < horizon:
        power *= 10
    assert power + 1 < horizon
    return [power - 2, power - 1, power, power + 1]


async def _write(db: asyncpg.Connection) -> list[int]:
    xids = await _xids(db)
    for n, xid in enumerate(xids):
        await db.execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,"
            " payload, xid) VALUES ($1, 'test', $2, 'test.e', '{}', $3::text::xid8)",
            uuid.uuid4(), str(n), str(xid),
        )  # fmt: skip
    return xids


async def test_events_are_read_in_numeric_transaction_order_a_batch_at_a_time(
    db: asyncpg.Connection,
) -> None:
    xids = await _write(db)
    horizon = await console.stream_horizon(db)
    seen: list[int] = []
    cursor = None
    while batch := await console.stream_events(db, cursor, horizon, 1):
        seen += [event.cursor.xid for event in batch]
        cursor = batch[-1].cursor
    assert seen == xids


async def test_the_tail_is_the_numerically_newest_event(db: asyncpg.Connection) -> None:
    xids = await _write(db)
    tail = await console.stream_tail(db)
    assert tail.xid == max(xids)
