"""The crash-loop breaker's memory (migration 0016): which messages were in flight when a
node died, and how many times in a row. Each call is its own statement, outside any batch
transaction: what it writes must survive the process dying mid-batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from storage.sql import load_queries

_Q = load_queries("breaker.sql")
WRITE_JOURNAL = _Q["write_journal"]
CLEAR_JOURNAL = _Q["clear_journal"]
RECOVER_JOURNAL = _Q["recover_journal"]
FORGET_SUSPECTS = _Q["forget_suspects"]
KEEP_QUARANTINED = _Q["keep_quarantined"]
TAKE_UNBOUNDED_TELEMETRY = _Q["take_unbounded_telemetry"]


@dataclass(frozen=True, slots=True)
class UnboundedTelemetry:
    """A telemetry row stored at PostgreSQL's infinity (``future``) or -infinity."""

    event_id: str
    device_id: str
    future: bool
    seq: int | None
    metrics_json: str | None
    events_json: str | None


DIGEST_BYTES = 16  # each digest in the journal's one bytea (recover_journal cuts it)


async def write_journal(
    conn: asyncpg.Connection, node_id: str, digests: Sequence[bytes], *, remember_days: int
) -> dict[bytes, int]:
    """Replace the node's journal with ``digests`` (each ``DIGEST_BYTES`` long); the deaths
    the fleet counted of each of them that is a suspect."""
    joined = b"".join(digests)
    if len(joined) != DIGEST_BYTES * len(digests):
        raise ValueError(f"journal digests are {DIGEST_BYTES} bytes each")
    rows = await conn.fetch(WRITE_JOURNAL, node_id, joined, remember_days)
    return {bytes(row["digest"]): int(row["deaths"]) for row in rows}


async def clear_journal(conn: asyncpg.Connection, node_id: str) -> None:
    await conn.execute(CLEAR_JOURNAL, node_id)


async def recover_journal(
    conn: asyncpg.Connection, node_id: str, *, remember_days: int
) -> dict[bytes, int]:
    """Count a death for what the node's journal holds; every suspect with its deaths."""
    rows = await conn.fetch(RECOVER_JOURNAL, node_id, remember_days)
    return {bytes(row["digest"]): int(row["deaths"]) for row in rows}


async def forget_suspects(conn: asyncpg.Connection, digests: Sequence[bytes]) -> None:
    await conn.execute(FORGET_SUSPECTS, digests)


async def keep_quarantined(conn: asyncpg.Connection, digests: Sequence[bytes]) -> None:
    """Quarantined again: remembered from now, not forgotten."""
    await conn.execute(KEEP_QUARANTINED, digests)


async def take_unbounded_telemetry(conn: asyncpg.Connection) -> list[UnboundedTelemetry]:
    """Delete and return telemetry stored at ±infinity (call in a transaction that keeps it
    as dead letters)."""
    rows = await conn.fetch(TAKE_UNBOUNDED_TELEMETRY)
    return [
        UnboundedTelemetry(
            row["event_id"], row["device_id"], row["future"], row["seq"], row[4], row[5]
        )
        for row in rows
    ]
