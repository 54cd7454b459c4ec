"""The MQTT topic filters each client id subscribed to on each broker (migration 0023), so
that a node can unsubscribe what an earlier configuration left in its persistent session."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from storage.sql import load_queries

_Q = load_queries("subscriptions.sql")
REMEMBER = _Q["remember_subscriptions"]
FORGET = _Q["forget_subscriptions"]


async def remember(
    conn: asyncpg.Connection, client_id: str, broker: str, filters: Sequence[str]
) -> set[str]:
    """Record ``filters``; every filter remembered for the client on that broker."""
    rows = await conn.fetch(REMEMBER, client_id, broker, list(filters))
    return {row[0] for row in rows}


async def forget(
    conn: asyncpg.Connection, client_id: str, broker: str, filters: Sequence[str]
) -> None:
    await conn.execute(FORGET, client_id, broker, list(filters))
