"""The command service: storage and the pure command domain, wired together.

Every transition is a conditional write with its audit row (and, for terminal outcomes, a
``command.finished`` outbox event) in the same transaction. A receipt is applied by one
update guarded by command id, claim generation, node id and an open status; when any guard
fails nothing changes, and the receipt is still kept with why it was not applied.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import msgspec
import structlog

from gateway.alarms.service import ConcurrentWriteError, create_alarm
from gateway.domain.command import (
    TERMINAL_STATUSES,
    CommandError,
    CommandStatus,
    Delivery,
    Guards,
    ReceiptOutcome,
    RejectReason,
    is_standard_result_code,
    judge_receipt,
    needs_people,
    receipt_effect,
    retry_delay_s,
)
from protocol import CommandReceipt, ReceiptResult
from protocol.events import Aggregate, CommandFinished, EventType
from storage import alarms as alarm_repo
from storage import commands as repo
from storage import outbox

log = structlog.get_logger(__name__)

AGGREGATE = Aggregate.COMMAND
DEVICE_ACTOR = "device"
DISPATCHER_ACTOR = "system:dispatcher"
REAPER_ACTOR = "system:reaper"
# The alarm raised for people when a command keeps losing its node (docs/behaviour.md §7).
RECLAIM_RULE_KEY = "command-reclaims"
RECLAIM_SEVERITY = "MAJOR"


class CommandNotFoundError(CommandError):
    code = "NOT_FOUND"

    def __init__(self, command_id: int) -> None:
        super().__init__(f"no command {command_id}")
        self.command_id = command_id


class DeviceUnboundError(CommandError):
    code = "DEVICE_UNBOUND"

    def __init__(self, device_id: str) -> None:
        super().__init__(f"device {device_id} is unbound: it takes no commands")
        self.device_id = device_id


class DownlinkTooLargeError(CommandError):
    """The command's downlink cannot fit the broker's maximum packet size whatever node sends
    it: refused before anything is created."""

    code = "DOWNLINK_TOO_LARGE"

    def __init__(self, device_id: str, size: int, limit: int) -> None:
        super().__init__(
            f"the downlink to {device_id} would be at least {size} bytes, over the broker's"
            f" maximum packet size {limit} ([mqtt] max_packet_size): send smaller params"
        )
        self.device_id = device_id
        self.size = size
        self.limit = limit


class CommandClosedError(CommandError):
    code = "ILLEGAL_TRANSITION"

    def __init__(self, command_id: int, status: str) -> None:
        super().__init__(f"command {command_id} is {status}: it cannot be cancelled")
        self.command_id = command_id
        self.status = status


def command_to_json(row: asyncpg.Record) -> dict[str, Any]:
    body = {k: v for k, v in row.items() if k not in {"legacy_claim", "previous_status"}}
    body["params"] = (
        msgspec.json.decode(row["params"]) if isinstance(row["params"], str) else (row["params"])
    )
    converted: dict[str, Any] = msgspec.to_builtins(body)
    return converted


async def _record(
    conn: asyncpg.Connection,
    row: asyncpg.Record,
    *,
    from_status: str | None,
    actor: str,
    action: str,
    node_id: str,
    note: str | None = None,
) -> None:
    await repo.insert_audit(
        conn,
        command_id=row["id"],
        actor=actor,
        action=action,
        from_status=from_status,
        to_status=row["status"],
        generation=row["claim_generation"],
        node_id=node_id,
        note=note,
    )
    if CommandStatus(row["status"]) in (
        CommandStatus.ACKED,
        CommandStatus.FAILED,
        CommandStatus.TIMEOUT,
        CommandStatus.CANCELLED,
    ):
        await outbox.add_event(
            conn,
            aggregate_type=AGGREGATE,
            aggregate_id=str(row["id"]),
            event_type=EventType.COMMAND_FINISHED,
            payload=CommandFinished(command=command_to_json(row), actor=actor),
        )


@dataclass(frozen=True, slots=True)
class Created:
    command: asyncpg.Record
    created: bool


async def create_command(
    conn: asyncpg.Connection,
    *,
    device_id: str,
    name: str,
    params: dict[str, Any],
    delivery: Delivery,
    idempotency_key: str | None,
    created_by: str,
    node_id: str,
    expire_after_s: float,
) -> Created:
    """A new PENDING command, or the device's existing one with the same idempotency key."""
    if await repo.device_bound(conn, device_id) is False:
        raise DeviceUnboundError(device_id)
    row = await repo.insert(
        conn,
        device_id=device_id,
        name=name,
        params=params,
        delivery=delivery.value,
        idempotency_key=idempotency_key,
        created_by=created_by,
        expire_after_s=expire_after_s,
    )
    if row is None:
        assert idempotency_key is not None
        existing = await repo.by_idempotency_key(conn, device_id, idempotency_key)
        assert existing is not None
        return Created(existing, created=False)
    await _record(conn, row, from_status=None, actor=created_by, action="create", node_id=node_id)
    return Created(row, created=True)


@dataclass(frozen=True, slots=True)
class ReceiptResultRecord:
    outcome: ReceiptOutcome
    reason: RejectReason | None
    command: asyncpg.Record | None
    previous_status: str | None = None


async def apply_receipt(
    conn: asyncpg.Connection,
    *,
    device_id: str,
    receipt: CommandReceipt,
    node_id: str,
    sent_timeout_s: float,
    retry_base_s: float = 2.0,
    retry_cap_s: float = 600.0,
) -> ReceiptResultRecord:
    """Apply one device receipt in the caller's transaction; it is logged whatever happens.

    The effect depends on the status it is applied to, so the update is also guarded by that
    status. If only the status moved meanwhile (the dispatcher's CLAIMED → SENT racing a fast
    device), the receipt is applied again to the fresh row rather than lost.
    """
    updated = None
    current = None
    for _attempt in range(3):
        current = await repo.get(conn, receipt.command_id)
        if current is not None and current["device_id"] != device_id:
            current = None  # a device answering for another device's command: never trusted
        if not _may_apply(current, receipt):
            break
        assert current is not None
        assert receipt.claim_generation is not None
        effect = receipt_effect(
            delivery=Delivery(current["delivery"]),
            current=CommandStatus(current["status"]),
            result=receipt.result,
            result_code=receipt.result_code,
            retry_count=current["retry_count"],
        )
        updated = await repo.apply_receipt(
            conn,
            command_id=current["id"],
            generation=receipt.claim_generation,
            node_id=receipt.node_id or "",
            expected=current["status"],
            status=effect.status.value,
            result=effect.result,
            result_code=effect.result_code,
            raw_result_code=None
            if receipt.raw_result_code is None
            else str(receipt.raw_result_code),
            raw_ack=receipt.raw_ack,
            terminal=effect.terminal,
            retry=effect.retry,
            retry_delay_s=retry_delay_s(
                current["retry_count"], base_s=retry_base_s, cap_s=retry_cap_s
            ),
            timeout_s=sent_timeout_s,
        )
        if updated is not None:
            break
    if updated is not None and current is not None:
        outcome, reason = ReceiptOutcome.ACCEPTED, None
        changed = updated["status"] != current["status"]
        if changed or updated["retry_count"] != current["retry_count"]:
            await _record(
                conn,
                updated,
                from_status=current["status"],
                actor=DEVICE_ACTOR,
                action=f"receipt:{receipt.result.value}",
                node_id=node_id,
            )
    else:
        fresh = None if current is None else await repo.get(conn, current["id"])
        guards = Guards(
            command_exists=fresh is not None,
            status=None if fresh is None else CommandStatus(fresh["status"]),
            claim_generation=None if fresh is None else fresh["claim_generation"],
            claimed_node_id=None if fresh is None else fresh["claimed_node_id"],
        )
        outcome, reason = judge_receipt(
            guards,
            receipt_generation=receipt.claim_generation,
            receipt_node=receipt.node_id,
            result_code=receipt.result_code,
        )
        log.info(
            "receipt_not_applied",
            command_id=receipt.command_id,
            device_id=device_id,
            outcome=outcome.value,
            reason=None if reason is None else reason.value,
            receipt_generation=receipt.claim_generation,
            receipt_node=receipt.node_id,
            result_code=receipt.result_code,
        )
    await repo.insert_receipt(
        conn,
        command_id=None if current is None else current["id"],
        reported_command_id=receipt.command_id,
        device_id=device_id,
        generation=receipt.claim_generation,
        node_id=receipt.node_id,
        result=receipt.result.value,
        result_code=receipt.result_code,
        raw_result_code=None if receipt.raw_result_code is None else str(receipt.raw_result_code),
        raw_ack=receipt.raw_ack,
        outcome=outcome.value,
        reason=None if reason is None else reason.value,
        received_by=node_id,
    )
    previous = None if updated is None or current is None else str(current["status"])
    return ReceiptResultRecord(outcome, reason, updated, previous)


async def apply_receipts(
    conn: asyncpg.Connection,
    receipts: Sequence[tuple[str, CommandReceipt]],
    *,
    node_id: str,
    sent_timeout_s: float,
    retry_base_s: float = 2.0,
    retry_cap_s: float = 600.0,
) -> list[ReceiptResultRecord]:
    """:func:`apply_receipt` for a batch (device id, receipt), in the caller's transaction; the
    results in the receipts' order.

    The common case, one receipt for an open command whose guards hold, is applied in a few
    statements for the whole batch: one read, one guarded update, one insert each for the
    audit rows, the outbox events and the receipt log. Everything else (a command named twice
    in the batch, a guard that fails, a status that moved between the read and the update) goes
    through :func:`apply_receipt` one by one, which judges and logs it exactly as before.
    """
    named = Counter(receipt.command_id for _, receipt in receipts)
    once = [receipt.command_id for _, receipt in receipts if named[receipt.command_id] == 1]
    rows = {row["id"]: row for row in await repo.get_many(conn, once)} if once else {}
    planned: list[tuple[int, str, CommandReceipt, asyncpg.Record, Any]] = []
    for index, (device_id, receipt) in enumerate(receipts):
        current = rows.get(receipt.command_id) if named[receipt.command_id] == 1 else None
        if current is None or current["device_id"] != device_id or not _may_apply(current, receipt):
            continue
        effect = receipt_effect(
            delivery=Delivery(current["delivery"]),
            current=CommandStatus(current["status"]),
            result=receipt.result,
            result_code=receipt.result_code,
            retry_count=current["retry_count"],
        )
        planned.append((index, device_id, receipt, current, effect))
    updated: dict[int, asyncpg.Record] = {}
    if planned:
        columns: list[list[Any]] = [[] for _ in range(13)]
        for _, _, receipt, current, effect in sorted(planned, key=lambda p: p[3]["id"]):
            values = (
                current["id"],
                receipt.claim_generation,
                receipt.node_id,
                current["status"],
                effect.status.value,
                effect.result,
                effect.result_code,
                _raw_code(receipt),
                receipt.raw_ack,
                effect.terminal,
                1 if effect.retry else 0,
                retry_delay_s(current["retry_count"], base_s=retry_base_s, cap_s=retry_cap_s),
                sent_timeout_s,
            )
            for column, value in zip(columns, values, strict=True):
                column.append(value)
        updated = {row["id"]: row for row in await repo.apply_receipts(conn, columns)}
    results: dict[int, ReceiptResultRecord] = {}
    audits: list[tuple[Any, ...]] = []
    events: list[tuple[str, CommandFinished]] = []
    logged: list[tuple[Any, ...]] = []
    for index, device_id, receipt, current, _effect in planned:
        row = updated.get(current["id"])
        if row is None:
            continue  # the row moved since it was read: judged again, alone, below
        if row["status"] != current["status"] or row["retry_count"] != current["retry_count"]:
            audits.append(
                (row["id"], DEVICE_ACTOR, f"receipt:{receipt.result.value}", current["status"],
                 row["status"], row["claim_generation"], node_id)
            )  # fmt: skip
            if CommandStatus(row["status"]) in TERMINAL_STATUSES:
                events.append(
                    (
                        str(row["id"]),
                        CommandFinished(command=command_to_json(row), actor=DEVICE_ACTOR),
                    )
                )
        logged.append(
            (row["id"], receipt.command_id, device_id, receipt.claim_generation, receipt.node_id,
             receipt.result.value, receipt.result_code, _raw_code(receipt), receipt.raw_ack,
             ReceiptOutcome.ACCEPTED.value, None, node_id)
        )  # fmt: skip
        results[index] = ReceiptResultRecord(
            ReceiptOutcome.ACCEPTED, None, row, str(current["status"])
        )
    await repo.insert_audits(conn, audits)
    if events:
        await outbox.add_events(
            conn, aggregate_type=AGGREGATE, event_type=EventType.COMMAND_FINISHED, events=events
        )
    await repo.insert_receipts(conn, logged)
    for index, (device_id, receipt) in enumerate(receipts):
        if index not in results:
            results[index] = await apply_receipt(
                conn,
                device_id=device_id,
                receipt=receipt,
                node_id=node_id,
                sent_timeout_s=sent_timeout_s,
                retry_base_s=retry_base_s,
                retry_cap_s=retry_cap_s,
            )
    return [results[index] for index in range(len(receipts))]


def _raw_code(receipt: CommandReceipt) -> str | None:
    return None if receipt.raw_result_code is None else str(receipt.raw_result_code)


def _may_apply(current: asyncpg.Record | None, receipt: CommandReceipt) -> bool:
    """The four guards, read from the row: the same claim, and still open; and a result code
    the command's standard field may hold (the receipt keeps any other, as sent)."""
    return (
        is_standard_result_code(receipt.result_code)
        and current is not None
        and receipt.claim_generation is not None
        and receipt.claim_generation == current["claim_generation"]
        and receipt.node_id is not None
        and receipt.node_id == current["claimed_node_id"]
        and CommandStatus(current["status"]) in (CommandStatus.CLAIMED, CommandStatus.SENT)
    )


async def mark_sent(
    conn: asyncpg.Connection | asyncpg.Pool,
    row: asyncpg.Record,
    *,
    node_id: str,
    sent_timeout_s: float,
) -> asyncpg.Record | None:
    """The broker acknowledged the downlink: CLAIMED → SENT, if the claim is still ours.

    One statement writes the change and its audit row, so it needs no transaction of its own
    (SENT is never terminal: no outbox event).
    """
    return await repo.mark_sent(
        conn,
        command_id=row["id"],
        generation=row["claim_generation"],
        node_id=node_id,
        timeout_s=sent_timeout_s,
        actor=DISPATCHER_ACTOR,
    )


async def fail_unsendable(
    conn: asyncpg.Connection, row: asyncpg.Record, *, node_id: str, code: str, reason: str
) -> asyncpg.Record | None:
    """The broker can never take this claim's downlink (``code``: ``PACKET_TOO_LARGE``, or the
    name of the PUBACK's final reason code): CLAIMED → FAILED at once, whatever its delivery
    class, with its audit row and ``command.finished`` event, in the caller's transaction. None
    when the claim is not ours any more (its new owner meets the same refusal)."""
    failed = await repo.fail_unsendable(
        conn, row["id"], row["claim_generation"], node_id=node_id, code=code, reason=reason
    )
    if failed is not None:
        await _record(
            conn,
            failed,
            from_status="CLAIMED",
            actor=DISPATCHER_ACTOR,
            action="unsendable",
            node_id=node_id,
            note=f"{code}: {reason}",
        )
    return failed


async def cancel(
    conn: asyncpg.Connection, command_id: int, *, actor: str, node_id: str
) -> asyncpg.Record:
    """The cancelled row, with ``previous_status``: the status it left."""
    row = await repo.cancel(conn, command_id)
    if row is None:
        current = await repo.get(conn, command_id)
        if current is None:
            raise CommandNotFoundError(command_id)
        raise CommandClosedError(command_id, current["status"])
    await _record(
        conn, row, from_status=row["previous_status"], actor=actor, action="cancel", node_id=node_id
    )
    return row


async def unbind(
    conn: asyncpg.Connection, device_id: str, *, actor: str, node_id: str
) -> list[asyncpg.Record]:
    """The device takes no more commands; its open ones are cancelled (each row with
    ``previous_status``)."""
    await repo.unbind_device(conn, device_id)
    cancelled = await repo.cancel_open_of_device(conn, device_id)
    for row in cancelled:
        await _record(
            conn,
            row,
            from_status=row["previous_status"],
            actor=actor,
            action="unbind",
            node_id=node_id,
        )
    return cancelled


Transition = tuple[str, str]  # (from status, to status): one audited status change


@dataclass(slots=True)
class ReapReport:
    reclaimed: list[int]
    timed_out_receipts: list[int]
    failed: list[int]
    expired: list[tuple[int, str]]  # (id, the status it left)
    alarms: list[int]
    # Every status change the pass audited, whichever step made it (metrics count these).
    transitions: list[Transition] = field(default_factory=list)


async def reap(
    conn: asyncpg.Connection,
    *,
    node_id: str,
    ack_window_s: float,
    sent_timeout_s: float,
) -> ReapReport:
    """One pass of the reaper in the caller's transaction; every write is conditional."""
    report = ReapReport([], [], [], [], [])
    for row in await repo.reclaim_expired(conn):
        report.reclaimed.append(row["id"])
        report.transitions.append(("CLAIMED", row["status"]))
        note = f"lease expired (node {row['claimed_node_id']})"
        await _record(
            conn,
            row,
            from_status="CLAIMED",
            actor=REAPER_ACTOR,
            action="reclaim",
            node_id=node_id,
            note=note,
        )
        if needs_people(row["reclaim_count"]):
            alarm_id = await _reclaim_alarm(conn, row, node_id)
            if alarm_id is not None:
                report.alarms.append(alarm_id)
    if ack_window_s > 0:
        for row in await repo.ack_window_passed(conn, ack_window_s):
            # The node reports TIMEOUT itself: the same effect as a device's TIMEOUT receipt.
            own = CommandReceipt(
                command_id=row["id"],
                claim_generation=row["claim_generation"],
                node_id=row["claimed_node_id"],
                result=ReceiptResult.TIMEOUT,
                raw_ack=f"no receipt within {ack_window_s:g}s (reported by {node_id})",
            )
            applied = await apply_receipt(
                conn,
                device_id=row["device_id"],
                receipt=own,
                node_id=node_id,
                sent_timeout_s=sent_timeout_s,
            )
            if applied.outcome is ReceiptOutcome.ACCEPTED:
                report.timed_out_receipts.append(row["id"])
            moved = applied.command
            if moved is not None and applied.previous_status not in (None, moved["status"]):
                report.transitions.append((str(applied.previous_status), moved["status"]))
    for row in await repo.fail_sent_timeout(conn):
        report.failed.append(row["id"])
        report.transitions.append(("SENT", row["status"]))
        await _record(
            conn, row, from_status="SENT", actor=REAPER_ACTOR, action="timeout", node_id=node_id
        )
    for row in await repo.expire(conn):
        report.expired.append((row["id"], row["previous_status"]))
        report.transitions.append((row["previous_status"], row["status"]))
        await _record(
            conn,
            row,
            from_status=row["previous_status"],
            actor=REAPER_ACTOR,
            action="expire",
            node_id=node_id,
        )
    return report


async def _reclaim_alarm(conn: asyncpg.Connection, row: asyncpg.Record, node_id: str) -> int | None:
    # One alarm per command that crossed the limit: the dedup key is derived from the command.
    stand_in = hashlib.sha256(f"command-reclaims\n{row['id']}".encode()).hexdigest()
    try:
        async with conn.transaction():  # a savepoint: losing the race must not abort the pass
            creation = await create_alarm(
                conn,
                device_id=row["device_id"],
                rule_key=RECLAIM_RULE_KEY,
                severity=RECLAIM_SEVERITY,
                telemetry_event_id=stand_in,
                reason=(
                    f"command {row['id']} ({row['name']}) was reclaimed "
                    f"{row['reclaim_count']} times: its node keeps losing contact"
                ),
                node_id=node_id,
                now=await alarm_repo.db_now(conn),
            )
    except ConcurrentWriteError:
        return None
    return None if creation.alarm is None else creation.alarm.id
