"""Retention: telemetry day partitions made and dropped, and the other tables pruned in bounded
batches. Each call is its own short transaction; the caller holds the maintenance lock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Final

import asyncpg

from storage.sql import load_queries

# Any constant works as long as every node uses the same one: "gw-maint" in ASCII.
MAINTENANCE_LOCK_KEY: Final = 0x67772D6D61696E74
# How long a partition change may wait for its lock: past this it gives up (and is tried again
# at the next pass) rather than queue every ingest transaction behind a long reader.
PARTITION_LOCK_TIMEOUT: Final = "5s"
# How long a partition change may run once it has its lock (the pool's 60 s command timeout
# does not apply): making a day's partition moves that day's rows waiting in the default
# partition, in one transaction, however many. Cut off by the pool's timeout, the move rolled
# back and failed the whole pass, at every pass, each time holding ingest off for 60 s.
PARTITION_CHANGE_TIMEOUT_S: Final = 3600.0
# How long the lock holder's session may sit between two statements before PostgreSQL ends it,
# releasing the lock (idle_session_timeout; inside a transaction the pool's
# idle_in_transaction_session_timeout applies). A pass runs its statements back to back; a
# holder idle this long is a node that stopped (its VM paused, its process stopped, its link
# silent without a reset). TCP keepalive never ends such a session when the holder's kernel
# still answers, and every other node skipped every pass (no partitions made ahead, nothing
# pruned) until someone killed that process. Another node takes over at its next pass after.
LOCK_HOLDER_IDLE_S: Final = 30.0
# How often the lock holder's server session looks, while a statement of its runs, whether its
# client's socket is still open (client_connection_check_interval, PostgreSQL 14 and later):
# closed (a FIN or a reset reached the server: the node's host reset, its process killed, a
# firewall REJECT), the statement and the session are ended and the lock goes with them. A
# link cut under a running statement (a prune waiting on a row lock, a partition change moving
# a big day) otherwise left it running, and its session holding the lock, until it ended and
# the server tried to answer. It does not see a silent peer (no FIN, no reset): TCP keepalive
# (or the statement's end) is still what ends that one. A poll() of the socket per interval.
LOCK_HOLDER_CHECK_S: Final = 5.0

_Q = load_queries("maintenance.sql")
TRY_LOCK = _Q["try_lock"]
UNLOCK = _Q["unlock"]
LOCK_TIMEOUT = _Q["lock_timeout"]
DB_NOW = _Q["db_now"]
DAY_PARTITIONS = _Q["day_partitions"]
ADD_DAY_PARTITION = _Q["add_day_partition"]
DROP_DAY_PARTITION = _Q["drop_day_partition"]
DEFAULT_PARTITION_PAGES = _Q["default_partition_pages"]
PRUNE_DEFAULT_PARTITION = _Q["prune_default_partition"]
PRUNE_CONSUMED = _Q["prune_consumed"]
PRUNE_NOTIFY_GROUPS = _Q["prune_notify_groups"]
PRUNE_AI_PAYLOADS = _Q["prune_ai_payloads"]
PRUNE_STREAM_TICKETS = _Q["prune_stream_tickets"]
PRUNE_COMMAND_HEARING = _Q["prune_command_hearing"]
TABLE_SIZES = _Q["table_sizes"]
OLDEST_TELEMETRY_DAY = _Q["oldest_telemetry_day"]

# The tables pruned by walking their ids: name -> statement (see maintenance.sql).
WALKED: Final = {
    "dead_letter": _Q["prune_dead_letters"],
    "alarm_audit": _Q["prune_alarm_audit"],
    "command_audit": _Q["prune_command_audit"],
    "dead_letter_audit": _Q["prune_dead_letter_audit"],
    "command_receipt": _Q["prune_receipts"],
    "outbox_event": _Q["prune_outbox"],
    # The DEAD events of outbox_event (their own setting, outbox_dead_days).
    "outbox_event_dead": _Q["prune_outbox_dead"],
    "notify_delivery": _Q["prune_deliveries"],
}


async def try_lock(
    conn: asyncpg.Connection,
    *,
    idle_s: float = LOCK_HOLDER_IDLE_S,
    check_s: float = LOCK_HOLDER_CHECK_S,
) -> bool:
    """Take the maintenance lock for this session, unless another session holds it; the
    server then ends this session once it sits ``idle_s`` between statements (see
    ``LOCK_HOLDER_IDLE_S``), and, while a statement runs, once its client's socket is found
    closed, looked at every ``check_s`` (see ``LOCK_HOLDER_CHECK_S``), until :func:`unlock`."""
    idle = f"{round(idle_s * 1000)}ms"
    check = f"{round(check_s * 1000)}ms"
    return bool(await conn.fetchval(TRY_LOCK, MAINTENANCE_LOCK_KEY, idle, check))


async def unlock(conn: asyncpg.Connection) -> None:
    """Release the lock; the session is no longer ended for sitting idle nor checked for its
    client while a statement runs (both back to the session's defaults)."""
    await conn.fetchrow(UNLOCK, MAINTENANCE_LOCK_KEY)


async def db_now(conn: asyncpg.Connection) -> datetime:
    """The database's clock: the rows' own, whatever the node's says."""
    now: datetime = await conn.fetchval(DB_NOW)
    return now


async def day_partitions(conn: asyncpg.Connection) -> list[date]:
    return [row["day"] for row in await conn.fetch(DAY_PARTITIONS)]


async def add_day_partition(
    conn: asyncpg.Connection, day: date, *, lock_timeout: str = PARTITION_LOCK_TIMEOUT
) -> bool:
    """Create the partition of ``day`` (moving its rows out of the default partition).
    Raises ``asyncpg.LockNotAvailableError`` after waiting ``lock_timeout`` for its locks."""
    async with conn.transaction():
        await conn.execute(LOCK_TIMEOUT, lock_timeout)
        return bool(await conn.fetchval(ADD_DAY_PARTITION, day, timeout=PARTITION_CHANGE_TIMEOUT_S))


async def drop_day_partition(
    conn: asyncpg.Connection,
    day: date,
    received_before: datetime,
    *,
    lock_timeout: str = PARTITION_LOCK_TIMEOUT,
) -> bool:
    """Drop the partition of ``day``, keeping its rows received at or after
    ``received_before`` (they move to the default partition); as :func:`add_day_partition`
    for the lock."""
    async with conn.transaction():
        await conn.execute(LOCK_TIMEOUT, lock_timeout)
        return bool(
            await conn.fetchval(
                DROP_DAY_PARTITION, day, received_before, timeout=PARTITION_CHANGE_TIMEOUT_S
            )
        )


async def prune_default_partition(conn: asyncpg.Connection, before: datetime, *, pages: int) -> int:
    """Delete the default partition's rows received before ``before``, ``pages`` pages per
    statement; return how many went."""
    total_pages = int(await conn.fetchval(DEFAULT_PARTITION_PAGES))
    deleted = 0
    for first in range(0, total_pages, pages):
        status = await conn.execute(PRUNE_DEFAULT_PARTITION, first, first + pages, before)
        deleted += _count(status)
    return deleted


async def prune_walked(
    conn: asyncpg.Connection, table: str, before: datetime, *, chunk: int
) -> int:
    """Delete the rows of ``table`` (a key of ``WALKED``) past ``before`` that are not live,
    ``chunk`` rows looked at per statement; return how many went."""
    return await _walk(conn, WALKED[table], before, chunk)


async def prune_ai_payloads(
    conn: asyncpg.Connection, before: datetime, now: datetime, *, chunk: int
) -> int:
    """Clear the payloads of AI tasks finished before ``before``; return how many."""
    return await _walk(conn, PRUNE_AI_PAYLOADS, before, chunk, now)


async def prune_consumed(conn: asyncpg.Connection, before: datetime, *, chunk: int) -> int:
    return await _batches(conn, PRUNE_CONSUMED, chunk, before)


async def prune_notify_groups(conn: asyncpg.Connection, before: datetime, *, chunk: int) -> int:
    """Delete the notification groups made before ``before`` whose deliveries are all gone."""
    return await _batches(conn, PRUNE_NOTIFY_GROUPS, chunk, before)


async def prune_stream_tickets(conn: asyncpg.Connection, *, chunk: int) -> int:
    """Delete the expired stream tickets; return how many went."""
    return await _batches(conn, PRUNE_STREAM_TICKETS, chunk)


async def prune_command_hearing(conn: asyncpg.Connection, before: datetime, *, chunk: int) -> int:
    """Delete the ``command_hearing`` rows of nodes that have not passed since ``before``;
    return how many went."""
    return await _batches(conn, PRUNE_COMMAND_HEARING, chunk, before)


async def _batches(conn: asyncpg.Connection, query: str, chunk: int, *args: object) -> int:
    """``query`` (``$n`` the args, then the batch size) until a batch is short."""
    deleted = 0
    while True:
        done = int(await conn.fetchval(query, *args, chunk))
        deleted += done
        if done < chunk:
            return deleted


async def _walk(
    conn: asyncpg.Connection, query: str, before: datetime, chunk: int, *extra: object
) -> int:
    after, done = 0, 0
    while True:
        row = await conn.fetchrow(query, after, before, chunk, *extra)
        assert row is not None  # one row, always
        done += int(row["done"])
        if row["last_id"] is None or row["oldest"] >= before:
            return done
        after = int(row["last_id"])


@dataclass(frozen=True, slots=True)
class TableSize:
    name: str
    estimated_rows: float
    bytes: float


async def table_sizes(conn: asyncpg.Connection, tables: Sequence[str]) -> list[TableSize]:
    rows = await conn.fetch(TABLE_SIZES, list(tables))
    return [TableSize(r["name"], r["estimated_rows"], r["bytes"]) for r in rows]


async def oldest_telemetry_day(conn: asyncpg.Connection) -> date | None:
    day: date | None = await conn.fetchval(OLDEST_TELEMETRY_DAY)
    return day


def _count(status: str) -> int:
    """The row count of a command status such as ``DELETE 12``."""
    return int(status.rsplit(" ", 1)[-1])
