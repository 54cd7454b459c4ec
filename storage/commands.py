"""Command rows: claims, receipts and the reaper, as conditional writes on the caller's
connection. Rows come back as ``asyncpg.Record``; the gateway maps them to its domain."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from storage.sql import load_queries

_Q = load_queries("commands.sql")
GET = _Q["get"]
LIST_FOR_DEVICE = _Q["list_for_device"]
LIST_ALL = _Q["list_all"]
# Which statement pages a status (see commands.sql): ACKED and anything else, the generic one.
LIST_OF_STATUS = {
    "PENDING": _Q["list_pending"],
    "CLAIMED": _Q["list_in_flight"],
    "SENT": _Q["list_in_flight"],
    "FAILED": _Q["list_unsuccessful"],
    "TIMEOUT": _Q["list_unsuccessful"],
    "CANCELLED": _Q["list_unsuccessful"],
}
LIST_OTHER_STATUS = _Q["list_of_status"]
RECEIPTS_OF = _Q["receipts_of"]
CLAIM_DUE = _Q["claim_due"]
PLAN_ONCE = _Q["plan_once"]
MARK_SENT = _Q["mark_sent"]
RELEASE_UNSENT = _Q["release_unsent"]
FAIL_UNSENDABLE = _Q["fail_unsendable"]
APPLY_RECEIPT = _Q["apply_receipt"]
INSERT_RECEIPT = _Q["insert_receipt"]
INSERT_AUDIT = _Q["insert_audit"]
RECLAIM_EXPIRED = _Q["reclaim_expired"]
ACK_WINDOW_PASSED = _Q["ack_window_passed"]
FAIL_SENT_TIMEOUT = _Q["fail_sent_timeout"]
EXPIRE = _Q["expire"]
CANCEL = _Q["cancel"]
CANCEL_OPEN_OF_DEVICE = _Q["cancel_open_of_device"]
UNBIND_DEVICE = _Q["unbind_device"]


async def get(conn: asyncpg.Connection, command_id: int) -> asyncpg.Record | None:
    return await conn.fetchrow(GET, command_id)


async def list_for_device(
    conn: asyncpg.Connection, device_id: str, *, before_id: int | None, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(LIST_FOR_DEVICE, device_id, before_id, limit))


async def list_all(
    conn: asyncpg.Connection, *, status: str | None, before_id: int | None, limit: int
) -> list[asyncpg.Record]:
    if status is None:
        return list(await conn.fetch(LIST_ALL, before_id, limit))
    query = LIST_OF_STATUS.get(status, LIST_OTHER_STATUS)
    return list(await conn.fetch(query, status, before_id, limit))


async def receipts_of(conn: asyncpg.Connection, command_id: int) -> list[asyncpg.Record]:
    return list(await conn.fetch(RECEIPTS_OF, command_id))


async def claim_due(
    conn: asyncpg.Connection,
    *,
    node_id: str,
    lease_s: float,
    limit: int,
    max_in_flight: int,
    actor: str,
    now: datetime | None = None,
) -> list[asyncpg.Record]:
    """PENDING → CLAIMED for the due commands, with their audit rows, in one statement (it
    also locks the rollout buckets it spends). ``now`` is the rollout clock (tests drive it).

    The statement runs with the plan the connection made the first time (see ``plan_once``
    in commands.sql): the setting needs a transaction of its own, three short round trips
    (begin, the setting, commit) that save the claim's planning, 1.3-2.5 ms each time.
    """
    async with conn.transaction():
        await conn.execute(PLAN_ONCE)
        return list(await conn.fetch(CLAIM_DUE, node_id, lease_s, limit, max_in_flight, actor, now))


async def mark_sent(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    command_id: int,
    generation: int,
    node_id: str,
    timeout_s: float,
    actor: str,
) -> asyncpg.Record | None:
    """CLAIMED → SENT and its audit row, atomically in one statement (a pool will do)."""
    return await conn.fetchrow(MARK_SENT, command_id, generation, node_id, timeout_s, actor)


async def apply_receipt(
    conn: asyncpg.Connection,
    *,
    command_id: int,
    generation: int,
    node_id: str,
    expected: str,
    status: str,
    result: str,
    result_code: int | None,
    raw_result_code: str | None,
    raw_ack: str | None,
    terminal: bool,
    retry: bool,
    retry_delay_s: float,
    timeout_s: float,
) -> asyncpg.Record | None:
    """The four-guard update; None when any guard failed (nothing changed)."""
    return await conn.fetchrow(
        APPLY_RECEIPT,
        command_id,
        generation,
        node_id,
        expected,
        status,
        result,
        result_code,
        raw_result_code,
        raw_ack,
        terminal,
        1 if retry else 0,
        retry_delay_s,
        timeout_s,
    )


async def insert_receipt(
    conn: asyncpg.Connection,
    *,
    command_id: int | None,
    reported_command_id: int,
    device_id: str,
    generation: int | None,
    node_id: str | None,
    result: str,
    result_code: int | None,
    raw_result_code: str | None,
    raw_ack: str | None,
    outcome: str,
    reason: str | None,
    received_by: str,
) -> None:
    await conn.execute(
        INSERT_RECEIPT,
        command_id,
        reported_command_id,
        device_id,
        generation,
        node_id,
        result,
        result_code,
        raw_result_code,
        raw_ack,
        outcome,
        reason,
        received_by,
    )


async def insert_audit(
    conn: asyncpg.Connection,
    *,
    command_id: int,
    actor: str,
    action: str,
    from_status: str | None,
    to_status: str,
    generation: int,
    node_id: str,
    note: str | None = None,
) -> None:
    await conn.execute(
        INSERT_AUDIT,
        command_id,
        actor,
        action,
        from_status,
        to_status,
        generation,
        node_id,
        note,
    )


async def reclaim_expired(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(await conn.fetch(RECLAIM_EXPIRED))


async def ack_window_passed(conn: asyncpg.Connection, window_s: float) -> list[asyncpg.Record]:
    return list(await conn.fetch(ACK_WINDOW_PASSED, window_s))


async def fail_sent_timeout(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(await conn.fetch(FAIL_SENT_TIMEOUT))


async def expire(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(await conn.fetch(EXPIRE))


async def cancel(conn: asyncpg.Connection, command_id: int) -> asyncpg.Record | None:
    return await conn.fetchrow(CANCEL, command_id)


async def cancel_open_of_device(conn: asyncpg.Connection, device_id: str) -> list[asyncpg.Record]:
    return list(await conn.fetch(CANCEL_OPEN_OF_DEVICE, device_id))


async def unbind_device(conn: asyncpg.Connection, device_id: str) -> None:
    await conn.execute(UNBIND_DEVICE, device_id)


GET_MANY = _Q["get_many"]
MARK_SENT_MANY = _Q["mark_sent_many"]
APPLY_RECEIPTS = _Q["apply_receipts"]
INSERT_AUDITS = _Q["insert_audits"]
INSERT_RECEIPTS = _Q["insert_receipts"]


async def get_many(conn: asyncpg.Connection, ids: Sequence[int]) -> list[asyncpg.Record]:
    return list(await conn.fetch(GET_MANY, list(ids)))


async def mark_sent_many(
    conn: asyncpg.Connection | asyncpg.Pool,
    claims: Sequence[tuple[int, int]],
    *,
    node_id: str,
    timeout_s: float,
    actor: str,
) -> set[int]:
    """CLAIMED → SENT for many (id, generation) claims of this node, with audit rows, in one
    statement; the ids written. Rows another transaction holds are skipped (the caller retries
    them alone)."""
    rows = await conn.fetch(
        MARK_SENT_MANY, [c for c, _ in claims], [g for _, g in claims], node_id, timeout_s, actor
    )
    return {int(row["id"]) for row in rows}


async def release_unsent(
    conn: asyncpg.Connection | asyncpg.Pool,
    command_id: int,
    generation: int,
    *,
    node_id: str,
    actor: str,
    note: str,
) -> bool:
    """CLAIMED → PENDING without counting a reclaim (the downlink was never published: the
    broker session was down), with its audit row; False when the claim is not ours any more."""
    return (
        await conn.fetchval(RELEASE_UNSENT, command_id, generation, node_id, actor, note)
        is not None
    )


async def fail_unsendable(
    conn: asyncpg.Connection,
    command_id: int,
    generation: int,
    *,
    node_id: str,
    code: str,
    reason: str,
) -> asyncpg.Record | None:
    """CLAIMED → FAILED: the broker can never take the downlink; None when the claim is not
    ours any more."""
    return await conn.fetchrow(FAIL_UNSENDABLE, command_id, generation, node_id, code, reason)


async def apply_receipts(
    conn: asyncpg.Connection, columns: Sequence[Sequence[Any]]
) -> list[asyncpg.Record]:
    """The four-guard update for many receipts (one per command), as thirteen parallel arrays
    in the order of ``apply_receipts`` in commands.sql; the rows whose guards held."""
    return list(await conn.fetch(APPLY_RECEIPTS, *(list(c) for c in columns)))


async def insert_audits(conn: asyncpg.Connection, rows: Sequence[Sequence[Any]]) -> None:
    """Audit rows (command id, actor, action, from, to, generation, node), one statement."""
    if rows:
        await conn.execute(INSERT_AUDITS, *(list(col) for col in zip(*rows, strict=True)))


async def insert_receipts(conn: asyncpg.Connection, rows: Sequence[Sequence[Any]]) -> None:
    """Receipt log rows (the columns of insert_receipt, in order), one statement."""
    if rows:
        await conn.execute(INSERT_RECEIPTS, *(list(col) for col in zip(*rows, strict=True)))


UNBOUND_AMONG = _Q["unbound_among"]
INSERT_MANY = _Q["insert_many"]
BY_IDEMPOTENCY_KEYS = _Q["by_idempotency_keys"]


async def unbound_among(conn: asyncpg.Connection, device_ids: Sequence[str]) -> set[str]:
    """Those of ``device_ids`` registered as unbound."""
    return {r["device_id"] for r in await conn.fetch(UNBOUND_AMONG, list(device_ids))}


async def insert_many(
    conn: asyncpg.Connection,
    rows: Sequence[tuple[str, str, dict[str, Any], str, str | None, str]],
    *,
    expire_after_s: float,
    node_id: str,
) -> list[asyncpg.Record]:
    """New commands (device, name, params, delivery, idempotency key, created by), ids in
    the order given, each with its audit row, in one statement: the rows inserted, by id.
    A row whose device already has its key, or whose key an earlier row took, is left out."""
    if not rows:
        return []
    devices, names, params, deliveries, keys, creators = zip(*rows, strict=True)
    return list(
        await conn.fetch(
            INSERT_MANY,
            list(devices),
            list(names),
            [msgspec.json.encode(p).decode() for p in params],
            list(deliveries),
            list(keys),
            list(creators),
            expire_after_s,
            node_id,
        )
    )


async def by_idempotency_keys(
    conn: asyncpg.Connection, pairs: Sequence[tuple[str, str]]
) -> list[asyncpg.Record]:
    """The commands holding these (device, idempotency key) pairs."""
    if not pairs:
        return []
    return list(await conn.fetch(BY_IDEMPOTENCY_KEYS, [d for d, _ in pairs], [k for _, k in pairs]))
