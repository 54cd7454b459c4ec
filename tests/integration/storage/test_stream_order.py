"""The stream's reads order events by transaction id as a number, not as the text it is sent
as: across a change in the number of digits (9999 → 10000) nothing is skipped."""

from __future__ import annotations

import uuid

import asyncpg

from storage import console

XIDS = [9_998, 9_999, 10_000, 10_001]  # every one long finished on any server


async def _write(db: asyncpg.Connection) -> None:
    for n, xid in enumerate(XIDS):
        await db.execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,"
            " payload, xid) VALUES ($1, 'test', $2, 'test.e', '{}', $3::text::xid8)",
            uuid.uuid4(), str(n), str(xid),
        )  # fmt: skip


async def test_events_are_read_in_numeric_transaction_order_a_batch_at_a_time(
    db: asyncpg.Connection,
) -> None:
    await _write(db)
    horizon = await console.stream_horizon(db)
    seen: list[int] = []
    cursor = None
    while batch := await console.stream_events(db, cursor, horizon, 1):
        seen += [event.cursor.xid for event in batch]
        cursor = batch[-1].cursor
    assert seen == XIDS


async def test_the_tail_is_the_numerically_newest_event(db: asyncpg.Connection) -> None:
    await _write(db)
    tail = await console.stream_tail(db)
    assert tail.xid == max(XIDS)
