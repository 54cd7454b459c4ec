"""The MQTT topic filters each client id subscribed to on each broker (migration 0023), so
that a node can unsubscribe what an earlier configuration left in its persistent session, and
whether each was proven to deliver there (migration 0038), so that a resumed session need not
be probed again."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from storage.sql import load_queries

_Q = load_queries("subscriptions.sql")
REMEMBER = _Q["remember_subscriptions"]
FORGET = _Q["forget_subscriptions"]
PROVE = _Q["prove_subscriptions"]


async def remember(
    conn: asyncpg.Connection, client_id: str, broker: str, filters: Sequence[str]
) -> dict[str, bool]:
    """Record ``filters``; every filter remembered for the client on that broker, with whether
    it was proven to deliver there."""
    rows = await conn.fetch(REMEMBER, client_id, broker, list(filters))
    return {row[0]: row[1] for row in rows}


async def forget(
    conn: asyncpg.Connection, client_id: str, broker: str, filters: Sequence[str]
) -> None:
    await conn.execute(FORGET, client_id, broker, list(filters))


async def prove(
    conn: asyncpg.Connection, client_id: str, broker: str, filters: Sequence[str], *, proven: bool
) -> None:
    """``filters`` proven to deliver now, or (``proven`` False) not proven any more."""
    await conn.execute(PROVE, client_id, broker, list(filters), proven)
