"""Which metric names and event types stored telemetry carries, in a window of its receipt
(`received_at`, the database's clock), whatever the devices' clocks said."""

from __future__ import annotations

from datetime import datetime

import asyncpg

from storage.sql import load_queries

_Q = load_queries("telemetry_names.sql")
METRIC_NAMES = _Q["metric_names"]
EVENT_TYPES = _Q["event_types"]
METRIC_SEEN = _Q["metric_seen"]
EVENT_SEEN = _Q["event_seen"]


async def metric_names(
    conn: asyncpg.Connection, since: datetime, *, max_rows: int | None = None
) -> list[str]:
    """Distinct metric names of the rows received since ``since`` (of at most ``max_rows`` rows)."""
    return [row[0] for row in await conn.fetch(METRIC_NAMES, since, max_rows)]


async def event_types(
    conn: asyncpg.Connection, since: datetime, *, max_rows: int | None = None
) -> list[str]:
    """Distinct event types of the rows received since ``since`` (of at most ``max_rows`` rows)."""
    return [row[0] for row in await conn.fetch(EVENT_TYPES, since, max_rows)]


async def metric_seen(conn: asyncpg.Connection, since: datetime, name: str) -> bool:
    return bool(await conn.fetchval(METRIC_SEEN, since, name))


async def event_seen(conn: asyncpg.Connection, since: datetime, name: str) -> bool:
    return bool(await conn.fetchval(EVENT_SEEN, since, name))
