"""The alarm desk's rows: the list's filters, counts and groups, shelves, out-of-service
periods (docs/behaviour.md §5). Conditional writes on the caller's connection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import asyncpg

from storage.sql import load_queries

_Q = load_queries("desk.sql")

ShelvedMode = Literal["exclude", "only", "any"]
GroupBy = Literal["rule", "device"]
Scope = Literal["alarm", "pair"]


@dataclass(frozen=True, slots=True)
class Filters:
    """What the list, its groups and a bulk action over a group select (see desk.sql)."""

    statuses: Sequence[str] | None = None
    device_id: str | None = None
    rule_key: str | None = None
    open_only: bool = False
    active: bool | None = None
    cleared: bool | None = None
    acknowledged: bool | None = None
    shelved: ShelvedMode = "exclude"
    severity: str | None = None

    def args(self) -> tuple[object, ...]:
        return (
            None if self.statuses is None else list(self.statuses),
            self.device_id,
            self.rule_key,
            self.open_only,
            self.active,
            self.cleared,
            self.acknowledged,
            self.shelved,
            self.severity,
        )


@dataclass(frozen=True, slots=True)
class ReadAsOf:
    """The read a group was read in, as the bulk action over it compares alarms to it: the
    snapshot's bounds and the transactions running then (an alarm whose creating transaction
    is below ``xmin``, or below ``xmax`` and not running, was seen), and the read's time (the
    shelved filter is taken then as well as now)."""

    xmin: int
    xmax: int
    running: Sequence[int]
    at: datetime


async def _fetch_planned_per_call(
    conn: asyncpg.Connection, query: str, *args: object
) -> list[asyncpg.Record]:
    """``query``'s rows, planned for these arguments (``plan_cache_mode`` set for its own
    transaction only): asyncpg prepares each statement once per connection, and after five
    executions PostgreSQL may keep a generic plan, one for any filter: a scan of the whole
    history where the filter given (one device, one status) reads a few rows by an index.
    Planning costs a millisecond; a generic plan of a filtered read cost a hundred
    (scripts/desk-scale, docs/performance.md). Inside a caller's transaction (a savepoint
    here) the setting is put back afterwards; an error rolls it back with the savepoint."""
    nested = conn.is_in_transaction()
    async with conn.transaction():
        previous = await conn.fetchval(_Q["plan_per_call"])
        rows = list(await conn.fetch(query, *args))
        if nested:
            await conn.execute(_Q["plan_cache_mode_back"], previous)
        return rows


async def list_alarms(
    conn: asyncpg.Connection,
    filters: Filters,
    *,
    before_id: int | None,
    limit: int,
    as_of: ReadAsOf | None = None,
) -> list[asyncpg.Record]:
    """Alarm rows with ``shelved_until`` and ``out_of_service``, newest first; with ``as_of``
    (a read ``groups`` answered), only those whose creation it saw and that its shelved filter
    took then too."""
    read: tuple[object, ...] = (
        (None, None, None, None)
        if as_of is None
        else (as_of.xmin, as_of.xmax, list(as_of.running), as_of.at)
    )
    return await _fetch_planned_per_call(conn, _Q["list"], *filters.args(), before_id, limit, *read)


async def one(conn: asyncpg.Connection, alarm_id: int) -> asyncpg.Record | None:
    return await conn.fetchrow(_Q["one"], alarm_id)


async def chain(conn: asyncpg.Connection, alarm_id: int) -> list[asyncpg.Record]:
    """The alarm's supersede chain, oldest first, as ``one`` gives each (empty: no alarm)."""
    return list(await conn.fetch(_Q["chain"], alarm_id))


async def groups(
    conn: asyncpg.Connection,
    filters: Filters,
    *,
    by: GroupBy,
    limit: int,
    before: tuple[int, int] | None = None,
) -> list[asyncpg.Record]:
    """Worst first, then newest; ``before``: after the group of that (worst, newest id)."""
    worst, newest = (None, None) if before is None else before
    return await _fetch_planned_per_call(
        conn, _Q["groups"], *filters.args(), by, limit, worst, newest
    )


async def counts(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(await conn.fetch(_Q["counts"]))


async def shelf_target(conn: asyncpg.Connection, alarm_id: int) -> asyncpg.Record | None:
    return await conn.fetchrow(_Q["shelf_target"], alarm_id)


async def insert_shelf(
    conn: asyncpg.Connection,
    *,
    scope: Scope,
    alarm_id: int | None,
    device_id: str,
    rule_key: str,
    reason: str,
    by: str,
    seconds: float,
    node_id: str,
    request_id: str | None,
) -> asyncpg.Record | None:
    """The new shelf, or None when one not ended covers the same alarm (or pair)."""
    return await conn.fetchrow(
        _Q["insert_shelf"],
        scope,
        alarm_id,
        device_id,
        rule_key,
        reason,
        by,
        seconds,
        node_id,
        request_id,
    )


async def open_shelf(
    conn: asyncpg.Connection, *, scope: Scope, alarm_id: int | None, device_id: str, rule_key: str
) -> asyncpg.Record | None:
    return await conn.fetchrow(_Q["open_shelf"], scope, alarm_id, device_id, rule_key)


async def get_shelf(conn: asyncpg.Connection, shelf_id: int) -> asyncpg.Record | None:
    return await conn.fetchrow(_Q["get_shelf"], shelf_id)


async def list_shelves(
    conn: asyncpg.Connection, *, in_force: bool, before_id: int | None, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(_Q["list_shelves"], in_force, before_id, limit))


async def lift_shelf(conn: asyncpg.Connection, shelf_id: int, by: str) -> asyncpg.Record | None:
    return await conn.fetchrow(_Q["lift_shelf"], shelf_id, by)


async def expire_shelf(conn: asyncpg.Connection, shelf_id: int, by: str) -> asyncpg.Record | None:
    return await conn.fetchrow(_Q["expire_shelf"], shelf_id, by)


async def expire_due(
    conn: asyncpg.Connection, now: datetime, by: str, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(_Q["expire_due"], now, by, limit))


async def audit_shelf_step(
    conn: asyncpg.Connection,
    shelf: asyncpg.Record,
    *,
    actor: str,
    action: str,
    note: str,
    request_id: str | None,
    node_id: str,
) -> list[int]:
    """An audit row on each alarm the shelf step concerns; their ids."""
    rows = await conn.fetch(
        _Q["audit_shelf_step"],
        shelf["scope"],
        shelf["alarm_id"],
        shelf["device_id"],
        shelf["rule_key"],
        actor,
        action,
        note,
        request_id,
        node_id,
    )
    return [int(r["alarm_id"]) for r in rows]


async def device_known(conn: asyncpg.Connection, device_id: str) -> bool:
    return bool(await conn.fetchval(_Q["device_known"], device_id))


async def end_open_period(
    conn: asyncpg.Connection, device_id: str, by: str
) -> asyncpg.Record | None:
    return await conn.fetchrow(_Q["end_open_period"], device_id, by)


async def insert_period(
    conn: asyncpg.Connection,
    *,
    device_id: str,
    reason: str,
    by: str,
    until: datetime | None,
    request_id: str | None,
) -> asyncpg.Record | None:
    """The new period; None when ``until`` is not in the future, or when another period not
    ended is in the way (one committed after :func:`end_open_period` looked)."""
    return await conn.fetchrow(_Q["insert_period"], device_id, reason, by, until, request_id)


async def until_ahead(conn: asyncpg.Connection, until: datetime | None) -> bool:
    """Whether a period until ``until`` (None: until ended) would be in force now."""
    return bool(await conn.fetchval(_Q["until_ahead"], until))


async def end_period_in_force(
    conn: asyncpg.Connection, device_id: str, by: str
) -> asyncpg.Record | None:
    return await conn.fetchrow(_Q["end_period_in_force"], device_id, by)


async def period_in_force(conn: asyncpg.Connection, device_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(_Q["period_in_force"], device_id)
