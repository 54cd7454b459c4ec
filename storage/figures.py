"""The alarm system's own figures: read-only queries over ``alarm`` and ``alarm_audit``
(``queries/figures.sql``), on the caller's connection. A window is ``[since, until)``."""

from __future__ import annotations

from datetime import datetime, timedelta

import asyncpg

from storage.sql import load_queries

_Q = load_queries("figures.sql")
NO_JIT = _Q["no_jit"]
PER_INTERVAL = _Q["per_interval"]
FLOODS = _Q["floods"]
TOP_RULES = _Q["top_rules"]
TOP_DEVICES = _Q["top_devices"]
CHATTERING = _Q["chattering"]
STALE = _Q["stale"]
OPERATORS = _Q["operators"]
GAUGES = _Q["gauges"]


async def no_jit(conn: asyncpg.Connection) -> None:
    """No JIT compilation for the rest of the caller's transaction."""
    await conn.execute(NO_JIT)


async def per_interval(
    conn: asyncpg.Connection, since: datetime, until: datetime
) -> list[asyncpg.Record]:
    """Every fixed 10-minute interval meeting the window, oldest first: ``starts_at, alarms``."""
    return list(await conn.fetch(PER_INTERVAL, since, until))


async def floods(
    conn: asyncpg.Connection, since: datetime, until: datetime, threshold: int
) -> list[asyncpg.Record]:
    """Runs of 10-minute intervals holding more than ``threshold`` alarms:
    ``starts_at, ends_at, intervals, alarms, peak``."""
    return list(await conn.fetch(FLOODS, since, until, threshold))


async def top_rules(
    conn: asyncpg.Connection, since: datetime, until: datetime, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(TOP_RULES, since, until, limit))


async def top_devices(
    conn: asyncpg.Connection, since: datetime, until: datetime, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(TOP_DEVICES, since, until, limit))


async def chattering(
    conn: asyncpg.Connection,
    since: datetime,
    until: datetime,
    *,
    within: timedelta,
    raises: int,
    limit: int,
) -> list[asyncpg.Record]:
    """``rule_key, device_id, alarms, peak, since, total`` (``total``: every chattering pair)."""
    return list(await conn.fetch(CHATTERING, since, until, within.total_seconds(), raises, limit))


async def stale(conn: asyncpg.Connection, before: datetime, limit: int) -> list[asyncpg.Record]:
    """The oldest open alarms raised before ``before``, with ``total``: all of them."""
    return list(await conn.fetch(STALE, before, limit))


async def operators(
    conn: asyncpg.Connection, since: datetime, until: datetime
) -> list[asyncpg.Record]:
    """People's actions per actor, and in all (``everyone``), with acknowledgement times."""
    return list(await conn.fetch(OPERATORS, since, until))


async def gauges(
    conn: asyncpg.Connection,
    now: datetime,
    *,
    within: timedelta,
    raises: int,
    chatter_since: datetime,
    stale_before: datetime,
) -> asyncpg.Record:
    """``last_10min, chattering, stale, open``."""
    row = await conn.fetchrow(
        GAUGES, now, within.total_seconds(), raises, chatter_since, stale_before
    )
    assert row is not None  # one row, always
    return row
