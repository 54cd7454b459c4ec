"""Command rows: claims, receipts and the reaper, as conditional writes on the caller's
connection. Commands come back as :class:`CommandRow` (``params`` decoded); the gateway maps
them to its domain."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from storage.errors import TRANSIENT_DB_ERRORS, StorageError
from storage.sql import load_queries


class CommandRow(msgspec.Struct, frozen=True, kw_only=True):
    """One ``command`` row, its columns in table order, ``params`` decoded."""

    id: int
    device_id: str
    name: str
    params: dict[str, Any]
    delivery: str
    status: str
    idempotency_key: str | None
    claim_generation: int
    claimed_node_id: str | None
    legacy_claim: bool
    claimed_at: datetime | None
    lease_expire_at: datetime | None
    sent_at: datetime | None
    timeout_at: datetime | None
    expire_at: datetime
    next_attempt_at: datetime
    finished_at: datetime | None
    retry_count: int
    reclaim_count: int
    result: str | None
    result_code: int | None
    raw_result_code: str | None
    raw_ack: str | None
    created_at: datetime
    updated_at: datetime
    created_by: str | None
    campaign_id: int | None
    paced: bool


class MovedCommandRow(CommandRow, frozen=True, kw_only=True):
    """A command row returned by a transition (expire, cancel) with the status it left."""

    previous_status: str


def _values(record: asyncpg.Record) -> dict[str, Any]:
    values = dict(record.items())
    if isinstance(values["params"], str):  # jsonb comes as its text
        values["params"] = msgspec.json.decode(values["params"])
    return values


def command_row(record: asyncpg.Record) -> CommandRow:
    """A command row from a statement returning ``command``'s columns: a column the row does
    not name fails here, not at a later lookup."""
    return CommandRow(**_values(record))


def moved_command_row(record: asyncpg.Record) -> MovedCommandRow:
    """:func:`command_row` for a statement that also returns ``previous_status``."""
    return MovedCommandRow(**_values(record))


def _rows(records: Sequence[asyncpg.Record]) -> list[CommandRow]:
    return [command_row(record) for record in records]


def _row(record: asyncpg.Record | None) -> CommandRow | None:
    return None if record is None else command_row(record)


_Q = load_queries("commands.sql")
GET = _Q["get"]
LIST_FOR_DEVICE = _Q["list_for_device"]
LIST_FOR_DEVICE_OF_STATUS = _Q["list_for_device_of_status"]
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
CLAIMS_OF = _Q["claims_of"]
FAIL_UNSENDABLE = _Q["fail_unsendable"]
APPLY_RECEIPT = _Q["apply_receipt"]
INSERT_RECEIPT = _Q["insert_receipt"]
INSERT_AUDIT = _Q["insert_audit"]
RECLAIM_EXPIRED = _Q["reclaim_expired"]
ACK_WINDOW_PASSED = _Q["ack_window_passed"]
RECORD_HEARING = _Q["record_hearing"]
FAIL_SENT_TIMEOUT = _Q["fail_sent_timeout"]
EXPIRE = _Q["expire"]
CANCEL = _Q["cancel"]
CHANGED_BY = _Q["changed_by"]
CANCEL_OPEN_OF_DEVICE = _Q["cancel_open_of_device"]
UNBIND_DEVICE = _Q["unbind_device"]
LOCK_DEVICE = _Q["lock_device"]
CLAIM_ANSWERED = _Q["claim_answered"]
LOCK_COMMAND = _Q["lock_command"]
OWN_RECEIPT_KEPT = _Q["own_receipt_kept"]


async def get(conn: asyncpg.Connection, command_id: int) -> CommandRow | None:
    return _row(await conn.fetchrow(GET, command_id))


async def list_for_device(
    conn: asyncpg.Connection,
    device_id: str,
    *,
    before_id: int | None,
    limit: int,
    status: str | None = None,
) -> list[CommandRow]:
    if status is None:
        return _rows(await conn.fetch(LIST_FOR_DEVICE, device_id, before_id, limit))
    return _rows(await conn.fetch(LIST_FOR_DEVICE_OF_STATUS, device_id, status, before_id, limit))


async def list_all(
    conn: asyncpg.Connection, *, status: str | None, before_id: int | None, limit: int
) -> list[CommandRow]:
    if status is None:
        return _rows(await conn.fetch(LIST_ALL, before_id, limit))
    query = LIST_OF_STATUS.get(status, LIST_OTHER_STATUS)
    return _rows(await conn.fetch(query, status, before_id, limit))


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
    mappings: Sequence[str] = (),
) -> list[CommandRow]:
    """PENDING → CLAIMED for the due commands, with their audit rows, in one statement (it
    also locks the rollout buckets it spends). ``now`` is the rollout clock (tests drive it).
    ``mappings``: the names of the [[ingest.mappings]] configured, whose devices answer no
    command: their SENT commands are not in flight.

    The statement runs with the plan the connection made the first time (see ``plan_once``
    in commands.sql): the setting needs a transaction of its own, three short round trips
    (begin, the setting, commit) that save the claim's planning, 1.3-2.5 ms each time.
    """
    claimed: list[asyncpg.Record] | None = None
    try:
        async with conn.transaction():
            await conn.execute(PLAN_ONCE)
            claimed = await conn.fetch(
                CLAIM_DUE, node_id, lease_s, limit, max_in_flight, actor, now, list(mappings)
            )
    except TRANSIENT_DB_ERRORS as exc:
        if claimed:  # the claim answered and its COMMIT did not: it may have committed
            raise ClaimCommitLostError(_rows(claimed), exc) from exc
        raise
    assert claimed is not None
    return _rows(claimed)


class ClaimCommitLostError(StorageError):
    """A claim's statement answered with ``rows``, and the answer to its COMMIT was lost with
    the connection (``error``): the claim may have committed, its commands CLAIMED by this
    node that knows nothing more of them."""

    def __init__(self, rows: list[CommandRow], error: BaseException) -> None:
        super().__init__(
            f"the COMMIT of a claim of {len(rows)} commands went unanswered: {error!r}"
        )
        self.rows = rows
        self.error = error


async def mark_sent(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    command_id: int,
    generation: int,
    node_id: str,
    timeout_s: float,
    actor: str,
    note: str | None = None,
) -> CommandRow | None:
    """CLAIMED → SENT and its audit row (with ``note``), atomically in one statement (a pool
    will do)."""
    return _row(
        await conn.fetchrow(MARK_SENT, command_id, generation, node_id, timeout_s, actor, note)
    )


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
) -> CommandRow | None:
    """The four-guard update; None when any guard failed (nothing changed)."""
    return _row(
        await conn.fetchrow(
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


async def reclaim_expired(conn: asyncpg.Connection) -> list[CommandRow]:
    return _rows(await conn.fetch(RECLAIM_EXPIRED))


async def ack_window_passed(
    conn: asyncpg.Connection,
    window_s: float,
    mappings: Sequence[str] = (),
    *,
    node_id: str = "",
    ack_window_s: float = 0.0,
    live_s: float = 0.0,
) -> list[CommandRow]:
    """SENT commands past ``window_s``, but those of devices read through ``mappings`` (the
    names configured: their commands go out on vendor topics, which answer no receipt), and
    those sent less than ``ack_window_s`` before the ``heard_through`` of another node (not
    ``node_id``) that passed within ``live_s``: it may hold their receipts unstored."""
    return _rows(
        await conn.fetch(ACK_WINDOW_PASSED, window_s, list(mappings), node_id, ack_window_s, live_s)
    )


async def record_hearing(conn: asyncpg.Connection, node_id: str, unstored_s: float) -> None:
    """The node's pass: it has stored what it received up to ``unstored_s`` ago."""
    await conn.execute(RECORD_HEARING, node_id, unstored_s)


async def fail_sent_timeout(conn: asyncpg.Connection) -> list[CommandRow]:
    return _rows(await conn.fetch(FAIL_SENT_TIMEOUT))


async def expire(conn: asyncpg.Connection) -> list[MovedCommandRow]:
    return [moved_command_row(r) for r in await conn.fetch(EXPIRE)]


async def cancel(conn: asyncpg.Connection, command_id: int) -> MovedCommandRow | None:
    record = await conn.fetchrow(CANCEL, command_id)
    return None if record is None else moved_command_row(record)


async def changed_by(conn: asyncpg.Connection, command_id: int) -> tuple[str, str | None] | None:
    """The command's status now and the actor of its latest change; None: no such command."""
    record = await conn.fetchrow(CHANGED_BY, command_id)
    return None if record is None else (record["status"], record["actor"])


async def cancel_open_of_device(conn: asyncpg.Connection, device_id: str) -> list[MovedCommandRow]:
    return [moved_command_row(r) for r in await conn.fetch(CANCEL_OPEN_OF_DEVICE, device_id)]


async def claim_answered(
    conn: asyncpg.Connection, command_id: int, generation: int, node_id: str
) -> bool:
    """Whether a receipt of this claim (generation and node) of the command was accepted."""
    return bool(await conn.fetchval(CLAIM_ANSWERED, command_id, generation, node_id))


async def lock_command(conn: asyncpg.Connection, command_id: int) -> None:
    """The command's row locked for the caller's transaction (waiting for one holding it)."""
    await conn.execute(LOCK_COMMAND, command_id)


async def own_receipt_kept(
    conn: asyncpg.Connection,
    command_id: int,
    generation: int,
    node_id: str,
    *,
    result: str,
    raw_result_code: str | None,
    raw_ack: str | None,
) -> bool:
    """Whether the receipt ``node_id`` wrote itself for its claim (``generation``) of the
    command, with that result, raw code and raw ack, is kept."""
    return bool(
        await conn.fetchval(
            OWN_RECEIPT_KEPT, command_id, generation, node_id, result, raw_result_code, raw_ack
        )
    )


async def unbind_device(conn: asyncpg.Connection, device_id: str) -> None:
    """Locks the device's row first (waiting for the creations that read it bound), then
    registers it unbound; the caller cancels its open commands in a later statement."""
    await conn.execute(LOCK_DEVICE, device_id)
    await conn.execute(UNBIND_DEVICE, device_id)


GET_MANY = _Q["get_many"]
MARK_SENT_MANY = _Q["mark_sent_many"]
APPLY_RECEIPTS = _Q["apply_receipts"]
INSERT_AUDITS = _Q["insert_audits"]
INSERT_RECEIPTS = _Q["insert_receipts"]


async def get_many(conn: asyncpg.Connection, ids: Sequence[int]) -> list[CommandRow]:
    return _rows(await conn.fetch(GET_MANY, list(ids)))


async def mark_sent_many(
    conn: asyncpg.Connection | asyncpg.Pool,
    claims: Sequence[tuple[int, int]],
    *,
    node_id: str,
    timeout_s: float,
    actor: str,
    note: str | None = None,
) -> set[int]:
    """CLAIMED → SENT for many (id, generation) claims of this node, with audit rows (with
    ``note``), in one statement; the ids written. Rows another transaction holds are skipped
    (the caller retries them alone)."""
    rows = await conn.fetch(
        MARK_SENT_MANY,
        [c for c, _ in claims],
        [g for _, g in claims],
        node_id,
        timeout_s,
        actor,
        note,
    )
    return {int(row["id"]) for row in rows}


async def still_claimed(
    conn: asyncpg.Connection | asyncpg.Pool, claims: Sequence[tuple[int, int]], *, node_id: str
) -> set[int]:
    """Of these claims (id, generation), the ids still CLAIMED by them on ``node_id``."""
    ids = [c for c, _ in claims]
    generations = [g for _, g in claims]
    records = await conn.fetch(CLAIMS_OF, ids, generations, node_id)
    return {r["id"] for r in records if r["status"] == "CLAIMED"}


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
) -> CommandRow | None:
    """CLAIMED → FAILED: the broker can never take the downlink; None when the claim is not
    ours any more."""
    return _row(await conn.fetchrow(FAIL_UNSENDABLE, command_id, generation, node_id, code, reason))


async def apply_receipts(
    conn: asyncpg.Connection, columns: Sequence[Sequence[Any]]
) -> list[CommandRow]:
    """The four-guard update for many receipts (one per command), as thirteen parallel arrays
    in the order of ``apply_receipts`` in commands.sql; the rows whose guards held."""
    return _rows(await conn.fetch(APPLY_RECEIPTS, *(list(c) for c in columns)))


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
) -> list[CommandRow]:
    """New commands (device, name, params, delivery, idempotency key, created by), ids in
    the order given, each with its audit row, in one statement: the rows inserted, by id.
    A row whose device already has its key, or whose key an earlier row took, is left out."""
    if not rows:
        return []
    devices, names, params, deliveries, keys, creators = zip(*rows, strict=True)
    return _rows(
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
) -> list[CommandRow]:
    """The commands holding these (device, idempotency key) pairs."""
    if not pairs:
        return []
    return _rows(
        await conn.fetch(BY_IDEMPOTENCY_KEYS, [d for d, _ in pairs], [k for _, k in pairs])
    )
