"""The transactional outbox: events written with the change that caused them, published later."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg
import msgspec

from protocol.events import Aggregate, EventPayload, EventType
from storage.sql import load_queries

_Q = load_queries("outbox.sql")
INSERT_EVENT = _Q["insert_event"]
INSERT_EVENTS = _Q["insert_events"]
CLAIM_PLAN = _Q["claim_plan"]
CLAIM_DUE = _Q["claim_due"]
MARK_PUBLISHED = _Q["mark_published"]
MARK_PUBLISHED_MANY = _Q["mark_published_many"]
MARK_FAILED = _Q["mark_failed"]
RELEASE = _Q["release"]
RELEASE_IN_DOUBT = _Q["release_in_doubt"]
MARK_DEAD = _Q["mark_dead"]
BACKLOG = _Q["backlog"]
RECORD_CONSUMED = _Q["record_consumed"]


@dataclass(frozen=True, slots=True)
class ClaimedEvent:
    id: int
    event_id: uuid.UUID
    aggregate_type: str
    aggregate_id: str
    event_type: str
    schema_version: int
    payload: str
    retry_count: int
    in_doubt_count: int
    created_at: datetime


async def add_event(
    conn: asyncpg.Connection,
    *,
    aggregate_type: Aggregate,
    aggregate_id: str,
    event_type: EventType,
    payload: EventPayload,
) -> uuid.UUID:
    """Insert an event on the caller's connection: it commits with the caller's change."""
    event_id = uuid.uuid4()
    await conn.execute(
        INSERT_EVENT,
        event_id,
        aggregate_type,
        aggregate_id,
        event_type,
        msgspec.json.encode(payload).decode(),
    )
    return event_id


async def add_events(
    conn: asyncpg.Connection,
    *,
    aggregate_type: Aggregate,
    event_type: EventType,
    events: Sequence[tuple[str, EventPayload]],
) -> list[uuid.UUID]:
    """`add_event` for many (aggregate id, payload) pairs in one statement, in their order."""
    event_ids = [uuid.uuid4() for _ in events]
    await conn.execute(
        INSERT_EVENTS,
        event_ids,
        aggregate_type,
        [aggregate_id for aggregate_id, _ in events],
        event_type,
        [msgspec.json.encode(payload).decode() for _, payload in events],
    )
    return event_ids


async def claim_due(
    conn: asyncpg.Connection, *, node_id: str, lease_s: float, limit: int
) -> list[ClaimedEvent]:
    """Claim up to ``limit`` due events (see `claim_due` in outbox.sql), in a transaction of
    its own: not inside a caller's, whose later statements its plan setting would reach."""
    if conn.is_in_transaction():
        raise RuntimeError("outbox.claim_due runs in a transaction of its own")
    async with conn.transaction():
        await conn.execute(CLAIM_PLAN)
        records = await conn.fetch(CLAIM_DUE, node_id, lease_s, limit)
    return [ClaimedEvent(**dict(r.items())) for r in records]


async def mark_published(conn: asyncpg.Connection, row_id: int, node_id: str) -> bool:
    return await conn.fetchval(MARK_PUBLISHED, row_id, node_id) is not None


async def mark_published_many(
    conn: asyncpg.Connection | asyncpg.Pool, row_ids: Sequence[int], node_id: str
) -> set[int]:
    """Mark many published in one statement; the ids whose lease this node still held."""
    return {row["id"] for row in await conn.fetch(MARK_PUBLISHED_MANY, list(row_ids), node_id)}


async def mark_failed(
    conn: asyncpg.Connection, row_id: int, node_id: str, *, retry_in_s: float, error: str
) -> int | None:
    value = await conn.fetchval(MARK_FAILED, row_id, node_id, retry_in_s, error)
    return None if value is None else int(value)


async def mark_dead(conn: asyncpg.Connection, row_id: int, node_id: str, *, reason: str) -> bool:
    """DEAD: the broker can never take it; False when this node no longer held it."""
    return await conn.fetchval(MARK_DEAD, row_id, node_id, reason) is not None


async def release(
    conn: asyncpg.Connection | asyncpg.Pool, row_ids: Sequence[int], node_id: str, *, error: str
) -> set[int]:
    """Back to PENDING, due at once, retry count unchanged (the broker session was down); the
    ids this node still held."""
    rows = await conn.fetch(RELEASE, list(row_ids), node_id, error)
    return {int(row["id"]) for row in rows}


async def release_in_doubt(
    conn: asyncpg.Connection | asyncpg.Pool, row_ids: Sequence[int], node_id: str, *, error: str
) -> set[int]:
    """`release`, counting one more connection that ended while each was the largest publish
    awaiting its PUBACK (``in_doubt_count``); the ids this node still held."""
    rows = await conn.fetch(RELEASE_IN_DOUBT, list(row_ids), node_id, error)
    return {int(row["id"]) for row in rows}


async def backlog(conn: asyncpg.Connection) -> tuple[int, float]:
    row = await conn.fetchrow(BACKLOG)
    assert row is not None
    return int(row["backlog"]), float(row["oldest_age_s"])


async def record_consumed(conn: asyncpg.Connection, consumer: str, event_id: uuid.UUID) -> bool:
    """True the first time; False when this consumer already consumed the event."""
    return await conn.fetchval(RECORD_CONSUMED, consumer, event_id) is not None
