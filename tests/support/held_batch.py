"""Deterministic batches of command creations, for tests.

A test connection holds an uncommitted command with an idempotency key; a creation with that
key waits for it in PostgreSQL, so its batch stays in flight while later requests queue behind
it. Releasing the hold (a rollback) lets that batch insert its own command, and the queued
requests then go together in the next batch. No sleeps: each step waits on what PostgreSQL or
the creator's queue shows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import asyncpg

from gateway.commands.service import CommandService
from gateway.domain.command import Delivery
from tests.support.waiting import wait_until

HOLD = "hold"
T = TypeVar("T")


async def lock_waiters(dsn: str) -> list[int]:
    """Backends of this database waiting for a lock (read outside any transaction: in one,
    pg_stat_activity would keep showing what it showed first)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'"
        )
    finally:
        await conn.close()
    return [r["pid"] for r in rows]


class Block:
    """An uncommitted command of ``device`` with ``key``: a batch inserting that key waits for
    this transaction; :meth:`release` rolls it back (the batch then inserts its own)."""

    def __init__(self, dsn: str, device: str, key: str) -> None:
        self.dsn, self.device, self.key = dsn, device, key

    async def __aenter__(self) -> Block:
        self.conn = await asyncpg.connect(self.dsn)
        self.tx = self.conn.transaction()
        await self.tx.start()
        await self.conn.execute(
            "INSERT INTO command (device_id, name, idempotency_key) VALUES ($1, 'held', $2)",
            self.device,
            self.key,
        )
        return self

    async def release(self) -> None:
        if not self.conn.is_closed():
            await self.tx.rollback()
            await self.conn.close()

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


@contextlib.asynccontextmanager
async def first_batch_held(service: CommandService, dsn: str) -> AsyncIterator[Block]:
    """A first creation (device and key ``HOLD``) whose batch is in flight, waiting in
    PostgreSQL, until the block is released (at the latest on exit); it is then created."""
    async with Block(dsn, HOLD, HOLD) as block:
        creation = service.create(
            device_id=HOLD, name="first", params={}, delivery=Delivery.REALTIME,
            idempotency_key=HOLD, actor="test",
        )  # fmt: skip
        first = asyncio.create_task(creation)
        await wait_until(lambda: lock_waiters(dsn), message="first batch blocked")
        assert service.creator.queued == 0
        assert not first.done()
        yield block
    created = await first
    assert created.created
    assert created.command.name == "first"


async def queue_in_order(
    service: CommandService, calls: list[Coroutine[Any, Any, T]]
) -> list[asyncio.Task[T]]:
    """Start the calls one after another, each queued before the next starts (arrival order)."""
    tasks: list[asyncio.Task[T]] = []
    for call in calls:
        tasks.append(asyncio.create_task(call))
        await wait_until(lambda: service.creator.queued == len(tasks))
    return tasks
