"""Reads for the operator console (devices, telemetry, dead letters), stream tickets, and the
outbox as the live stream reads it.

The stream's cursor is ``(xid, id)``: the transaction that wrote an event, then its id. Ids
come from a sequence and transactions commit out of id order, so "id > last seen" would skip
an event whose transaction committed late. Instead only events whose transaction, and every
older one, has ended are read (``xid < pg_snapshot_xmin``): that set is final, and in (xid,
id) order nothing can appear behind a cursor once it has been passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from storage.sql import load_queries

_Q = load_queries("console.sql")
DEVICE_PAGE = _Q["device_page"]
DEVICE = _Q["device"]
LATEST_SAMPLES = _Q["latest_samples"]
TELEMETRY_PAGE = _Q["telemetry_page"]
DEAD_LETTER_PAGE = _Q["dead_letter_page"]
DEAD_LETTER_EXISTS = _Q["dead_letter_exists"]
DEAD_LETTER = _Q["dead_letter"]
LOCK_DEAD_LETTER_FOR_DISCARD = _Q["lock_dead_letter_for_discard"]
DISCARD_DEAD_LETTER = _Q["discard_dead_letter"]
DEAD_LETTER_DISCARDED = _Q["dead_letter_discarded"]
INSERT_TICKET = _Q["insert_ticket"]
USE_TICKET = _Q["use_ticket"]
STREAM_CURSOR_AHEAD = _Q["stream_cursor_ahead"]
STREAM_HORIZON = _Q["stream_horizon"]
STREAM_EVENTS = _Q["stream_events"]
STREAM_TAIL = _Q["stream_tail"]


async def device_page(
    conn: asyncpg.Connection | asyncpg.Pool, *, presence: str | None, after: str | None, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(DEVICE_PAGE, presence, after, limit))


async def device(conn: asyncpg.Connection | asyncpg.Pool, device_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(DEVICE, device_id)


async def latest_samples(
    conn: asyncpg.Connection | asyncpg.Pool, device_id: str, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(LATEST_SAMPLES, device_id, limit))


async def telemetry_page(
    conn: asyncpg.Connection | asyncpg.Pool,
    device_id: str,
    *,
    since: datetime | None,
    until: datetime | None,
    before: tuple[datetime, str] | None,
    metric: str | None,
    limit: int,
) -> list[asyncpg.Record]:
    before_ts, before_id = (None, None) if before is None else before
    return list(
        await conn.fetch(
            TELEMETRY_PAGE, device_id, since, until, before_ts, before_id, metric, limit
        )
    )


async def dead_letter_page(
    conn: asyncpg.Connection | asyncpg.Pool, *, reason: str | None, before: int | None, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(DEAD_LETTER_PAGE, reason, before, limit))


async def dead_letter_exists(conn: asyncpg.Connection | asyncpg.Pool, dead_letter_id: int) -> bool:
    return bool(await conn.fetchval(DEAD_LETTER_EXISTS, dead_letter_id))


async def dead_letter(
    conn: asyncpg.Connection | asyncpg.Pool, dead_letter_id: int
) -> asyncpg.Record | None:
    """One dead letter with its payload as kept."""
    return await conn.fetchrow(DEAD_LETTER, dead_letter_id)


@dataclass(frozen=True, slots=True)
class Discarded:
    dead_letter_id: int
    actor: str
    at: datetime


class DiscardBusyError(Exception):
    """A replay holds the letter right now."""


async def discard_dead_letter(
    pool: asyncpg.Pool, dead_letter_id: int, *, actor: str, node_id: str, request_id: str | None
) -> tuple[Discarded | None, bool]:
    """Delete the letter with its audit row, in one transaction: (the discard, True) when
    this call discarded it; (the earlier discard, False) when someone had; (None, False) when
    there never was such a letter. Raises DiscardBusyError while a replay holds it."""
    async with pool.acquire() as conn, conn.transaction():
        locked = await conn.fetchval(LOCK_DEAD_LETTER_FOR_DISCARD, dead_letter_id)
        if locked is None:
            if await conn.fetchval(DEAD_LETTER_EXISTS, dead_letter_id):
                raise DiscardBusyError
            earlier = await conn.fetchrow(DEAD_LETTER_DISCARDED, dead_letter_id)
            return (None if earlier is None else Discarded(*earlier)), False
        row = await conn.fetchrow(DISCARD_DEAD_LETTER, dead_letter_id, actor, node_id, request_id)
        assert row is not None  # locked above, in this transaction
        return Discarded(*row), True


async def insert_ticket(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    digest: bytes,
    token_name: str,
    role: str,
    lifetime_s: float,
    token_check: bytes | None = None,
) -> datetime:
    """Store a ticket's digest (and ``token_check``, what binds it to the token it was issued
    to); when it expires (database clock)."""
    expires_at: datetime = await conn.fetchval(
        INSERT_TICKET, digest, token_name, role, lifetime_s, token_check
    )
    return expires_at


async def use_ticket(
    conn: asyncpg.Connection | asyncpg.Pool, digest: bytes
) -> tuple[str, str] | None:
    """(token name, role) of a valid ticket, now used; None if unknown, used or expired."""
    found = await use_bound_ticket(conn, digest)
    return None if found is None else (found[0], found[1])


async def use_bound_ticket(
    conn: asyncpg.Connection | asyncpg.Pool, digest: bytes
) -> tuple[str, str, bytes | None] | None:
    """(token name, role, token check) of a valid ticket, now used; None if unknown, used or
    expired."""
    row = await conn.fetchrow(USE_TICKET, digest)
    if row is None:
        return None
    check = row["token_check"]
    return row["token_name"], row["role"], None if check is None else bytes(check)


@dataclass(frozen=True, slots=True, order=True)
class Cursor:
    """A position in the stream: after the event (xid, id)."""

    xid: int
    id: int

    def __str__(self) -> str:
        return f"{self.xid}:{self.id}"


@dataclass(frozen=True, slots=True)
class StreamEvent:
    cursor: Cursor
    event_id: str
    event_type: str
    aggregate_type: str
    aggregate_id: str
    payload: str  # json text
    created_at: datetime


async def stream_horizon(conn: asyncpg.Connection | asyncpg.Pool) -> int:
    """Every transaction of this database with an xid below this has ended (those of other
    databases on the server write no events here, and hold no stream back)."""
    return int(await conn.fetchval(STREAM_HORIZON))


async def stream_events(
    conn: asyncpg.Connection | asyncpg.Pool, after: Cursor | None, horizon: int, limit: int
) -> list[StreamEvent]:
    """Final events after ``after`` (all of them with None), in (xid, id) order."""
    rows = await conn.fetch(
        STREAM_EVENTS,
        None if after is None else str(after.xid),
        None if after is None else after.id,
        str(horizon),
        limit,
    )
    return [
        StreamEvent(
            cursor=Cursor(int(r["xid"]), int(r["id"])),
            event_id=str(r["event_id"]),
            event_type=r["event_type"],
            aggregate_type=r["aggregate_type"],
            aggregate_id=r["aggregate_id"],
            payload=r["payload"],
            created_at=r["created_at"],
        )
        for r in rows
    ]


async def stream_cursor_ahead(conn: asyncpg.Connection | asyncpg.Pool, cursor: Cursor) -> bool:
    """Whether ``cursor`` is past every event a stream can have sent (a made-up one)."""
    horizon = await stream_horizon(conn)
    return bool(await conn.fetchval(STREAM_CURSOR_AHEAD, str(cursor.xid), cursor.id, str(horizon)))


async def stream_tail(conn: asyncpg.Connection | asyncpg.Pool) -> Cursor:
    """The cursor of the newest final event (0:0 when there is none): where a stream with no
    cursor starts."""
    row = await conn.fetchrow(STREAM_TAIL, str(await stream_horizon(conn)))
    return Cursor(0, 0) if row is None else Cursor(int(row["xid"]), int(row["id"]))
