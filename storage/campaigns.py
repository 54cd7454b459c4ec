"""Campaign rows: creation with all its commands, counts, the conditional close, and the
cancel of its open commands, each one statement on the caller's connection. Campaigns come
back as :class:`CampaignRow` (``params`` decoded; with ``counts`` where the statement counts)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from storage.commands import CommandRow, MovedCommandRow, command_row, moved_command_row
from storage.sql import load_queries

_Q = load_queries("campaigns.sql")
INSERT = _Q["insert"]
BY_IDEMPOTENCY_KEY = _Q["by_idempotency_key"]
INSERT_COMMANDS = _Q["insert_commands"]
LOCK_TARGETS = _Q["lock_targets"]
BOUND_DEVICES = _Q["bound_devices"]
GET = _Q["get"]
LIST = _Q["list"]
COMMANDS_OF = _Q["commands_of"]
RUNNING = _Q["running"]
LOCK_RUNNING = _Q["lock_running"]
STATUS_OF = _Q["status_of"]
CHANGED_BY = _Q["changed_by"]
COUNTS = _Q["counts"]
CLOSE = _Q["close"]
INSERT_AUDIT = _Q["insert_audit"]
AUDIT_OF = _Q["audit_of"]
CANCEL_OPEN_COMMANDS = _Q["cancel_open_commands"]
ANALYZE_COMMANDS = _Q["analyze_commands"]
LOCK_TIMEOUT = _Q["lock_timeout"]


class CampaignRow(msgspec.Struct, frozen=True, kw_only=True):
    """One ``campaign`` row, its columns in table order, ``params`` decoded."""

    id: int
    name: str
    params: dict[str, Any]
    delivery: str
    status: str
    target_devices: list[str] | None
    target_selector: list[str] | None
    device_ids: list[str]
    per_minute: int | None
    rollout_tokens: float | None
    rollout_at: datetime | None
    failure_ratio: float | None
    min_finished: int | None
    idempotency_key: str | None
    created_by: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    status_reason: str | None


class CountedCampaignRow(CampaignRow, frozen=True, kw_only=True):
    """A campaign with its commands' count per status (only the statuses some command has)."""

    counts: dict[str, int]


class RunningCampaign(msgspec.Struct, frozen=True, kw_only=True):
    """A RUNNING campaign as the settle loop reads it."""

    id: int
    may_abort: bool
    has_open: bool


def _values(record: asyncpg.Record) -> dict[str, Any]:
    values = dict(record.items())
    for column in ("params", "counts"):
        if isinstance(values.get(column), str):  # jsonb comes as its text
            values[column] = msgspec.json.decode(values[column])
    return values


def campaign_row(record: asyncpg.Record) -> CampaignRow:
    """A campaign row from a statement returning ``campaign``'s columns: a column the row does
    not name fails here, not at a later lookup."""
    return CampaignRow(**_values(record))


def _row(record: asyncpg.Record | None) -> CampaignRow | None:
    return None if record is None else campaign_row(record)


async def insert(
    conn: asyncpg.Connection,
    *,
    name: str,
    params: dict[str, Any],
    delivery: str,
    target_devices: Sequence[str] | None,
    target_selector: Sequence[str] | None,
    device_ids: Sequence[str],
    per_minute: int | None,
    failure_ratio: float | None,
    min_finished: int | None,
    idempotency_key: str | None,
    created_by: str,
) -> CampaignRow | None:
    """The new campaign, or None when a campaign already has that idempotency key."""
    return _row(
        await conn.fetchrow(
            INSERT,
            name,
            msgspec.json.encode(params).decode(),
            delivery,
            None if target_devices is None else list(target_devices),
            None if target_selector is None else list(target_selector),
            list(device_ids),
            per_minute,
            failure_ratio,
            min_finished,
            idempotency_key,
            created_by,
        )
    )


async def by_idempotency_key(conn: asyncpg.Connection, key: str) -> CampaignRow | None:
    return _row(await conn.fetchrow(BY_IDEMPOTENCY_KEY, key))


async def insert_commands(
    conn: asyncpg.Connection,
    *,
    campaign: CampaignRow,
    expire_after_s: float,
    node_id: str,
) -> int:
    """One PENDING command per device of the campaign, with audit rows, in one statement."""
    count = await conn.fetchval(
        INSERT_COMMANDS,
        campaign.id,
        campaign.name,
        msgspec.json.encode(campaign.params).decode(),
        campaign.delivery,
        campaign.created_by,
        expire_after_s,
        list(campaign.device_ids),
        node_id,
    )
    return int(count)


async def lock_targets(conn: asyncpg.Connection, device_ids: Sequence[str]) -> dict[str, bool]:
    """The known devices among ``device_ids``, each with whether it is bound, locked until the
    transaction ends (an unbind waits for it)."""
    return {r["device_id"]: r["bound"] for r in await conn.fetch(LOCK_TARGETS, list(device_ids))}


async def bound_devices(conn: asyncpg.Connection) -> list[str]:
    return [r["device_id"] for r in await conn.fetch(BOUND_DEVICES)]


async def get(
    conn: asyncpg.Connection | asyncpg.Pool, campaign_id: int
) -> CountedCampaignRow | None:
    """The campaign with ``counts`` (status → commands), read in one statement."""
    record = await conn.fetchrow(GET, campaign_id)
    return None if record is None else CountedCampaignRow(**_values(record))


async def list_campaigns(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    status: str | None,
    before_id: int | None,
    limit: int,
) -> list[CampaignRow]:
    return [campaign_row(r) for r in await conn.fetch(LIST, status, before_id, limit)]


async def commands_of(
    conn: asyncpg.Connection | asyncpg.Pool,
    campaign_id: int,
    *,
    status: str | None,
    before_id: int | None,
    limit: int,
) -> list[CommandRow]:
    return [
        command_row(r) for r in await conn.fetch(COMMANDS_OF, campaign_id, status, before_id, limit)
    ]


async def running(conn: asyncpg.Connection | asyncpg.Pool) -> list[RunningCampaign]:
    """The RUNNING campaigns: ``id``, ``may_abort`` and ``has_open``."""
    return [RunningCampaign(**dict(r.items())) for r in await conn.fetch(RUNNING)]


async def lock_running(conn: asyncpg.Connection, campaign_id: int) -> CampaignRow | None:
    return _row(await conn.fetchrow(LOCK_RUNNING, campaign_id))


async def counts(conn: asyncpg.Connection, campaign_id: int) -> dict[str, int]:
    return {r["status"]: int(r["n"]) for r in await conn.fetch(COUNTS, campaign_id)}


async def status_of(conn: asyncpg.Connection, campaign_id: int) -> str | None:
    """The campaign's status; None: no such campaign."""
    status: str | None = await conn.fetchval(STATUS_OF, campaign_id)
    return status


async def changed_by(conn: asyncpg.Connection, campaign_id: int) -> tuple[str, str | None] | None:
    """The campaign's status now and the actor of its latest change; None: no such campaign."""
    record = await conn.fetchrow(CHANGED_BY, campaign_id)
    return None if record is None else (record["status"], record["actor"])


async def close(
    conn: asyncpg.Connection,
    campaign_id: int,
    *,
    status: str,
    reason: str,
    actor: str,
    action: str,
    node_id: str,
    request_id: str | None,
) -> CampaignRow | None:
    """RUNNING → ``status`` with its audit row; None when it was not RUNNING (nothing changed)."""
    return _row(
        await conn.fetchrow(CLOSE, campaign_id, status, reason, actor, action, node_id, request_id)
    )


async def insert_audit(
    conn: asyncpg.Connection,
    *,
    campaign_id: int,
    actor: str,
    action: str,
    from_status: str | None,
    to_status: str,
    node_id: str,
    note: str | None = None,
    request_id: str | None = None,
) -> None:
    await conn.execute(
        INSERT_AUDIT, campaign_id, actor, action, from_status, to_status, node_id, note, request_id
    )


async def audit_of(
    conn: asyncpg.Connection | asyncpg.Pool, campaign_id: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(AUDIT_OF, campaign_id))


async def cancel_open_commands(
    conn: asyncpg.Connection, campaign_id: int, *, actor: str, action: str, node_id: str
) -> list[MovedCommandRow]:
    """Every open command of the campaign CANCELLED (rows with ``previous_status``)."""
    records = await conn.fetch(CANCEL_OPEN_COMMANDS, campaign_id, actor, action, node_id)
    return [moved_command_row(r) for r in records]


async def analyze_commands(conn: asyncpg.Connection, *, lock_timeout_s: float) -> None:
    """Refresh the command table's statistics; waits at most ``lock_timeout_s`` for the lock
    (a running VACUUM of the table holds it), then gives up with LockNotAvailableError."""
    async with conn.transaction():
        await conn.fetchval(LOCK_TIMEOUT, f"{round(lock_timeout_s * 1000)}ms")
        await conn.execute(ANALYZE_COMMANDS)
