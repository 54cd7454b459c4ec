"""Command receipts: a device's answer applied to its command, in the caller's transaction.

A receipt is applied by one update guarded by command id, claim generation, node id and an
open status; when any guard fails nothing changes, and the receipt is still kept with why it
was not applied. :class:`ReceiptApplier` applies a batch's receipts in the ingest transaction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import structlog

from gateway.commands.lifecycle import AGGREGATE, command_to_json, record_change
from gateway.commands.metrics import CommandMetrics
from gateway.domain.command import (
    TERMINAL_STATUSES,
    CommandStatus,
    Delivery,
    Guards,
    ReceiptOutcome,
    RejectReason,
    is_standard_result_code,
    judge_receipt,
    receipt_effect,
    retry_delay_s,
)
from gateway.support.metrics import Metrics
from protocol import CommandReceipt
from protocol.events import CommandFinished, EventType
from storage import commands as repo
from storage import outbox
from storage.commands import CommandRow

log = structlog.get_logger(__name__)

DEVICE_ACTOR = "device"


@dataclass(frozen=True, slots=True)
class AppliedReceipt:
    outcome: ReceiptOutcome
    reason: RejectReason | None
    command: CommandRow | None
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
) -> AppliedReceipt:
    """Apply one device receipt in the caller's transaction; it is logged whatever happens.

    The effect depends on the status it is applied to, so the update is also guarded by that
    status. If only the status moved meanwhile (the dispatcher's CLAIMED → SENT racing a fast
    device), the receipt is applied again to the fresh row rather than lost.
    """
    updated = None
    current = None
    tried: str | None = None  # the status the last update was guarded by
    for _attempt in range(3):
        current = await repo.get(conn, receipt.command_id)
        if current is not None and current.device_id != device_id:
            current = None  # a device answering for another device's command: never trusted
        if not _may_apply(current, receipt):
            break
        assert current is not None
        if current.status == tried:  # it did not move: a repeat, judged below
            break
        tried = current.status
        assert receipt.claim_generation is not None
        effect = receipt_effect(
            delivery=Delivery(current.delivery),
            current=CommandStatus(current.status),
            result=receipt.result,
            result_code=receipt.result_code,
            retry_count=current.retry_count,
        )
        updated = await repo.apply_receipt(
            conn,
            command_id=current.id,
            generation=receipt.claim_generation,
            node_id=receipt.node_id or "",
            expected=current.status,
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
                current.retry_count, base_s=retry_base_s, cap_s=retry_cap_s
            ),
            timeout_s=sent_timeout_s,
        )
        if updated is not None:
            break
    if updated is not None and current is not None:
        outcome, reason = ReceiptOutcome.ACCEPTED, None
        changed = updated.status != current.status
        if changed or updated.retry_count != current.retry_count:
            await record_change(
                conn,
                updated,
                from_status=current.status,
                actor=DEVICE_ACTOR,
                action=f"receipt:{receipt.result.value}",
                node_id=node_id,
            )
    else:
        fresh = None if current is None else await repo.get(conn, current.id)
        # PENDING with this very claim (generation and node): lapsed, or requeued by an
        # answer of that claim (a deferrable retry), which only the receipt log tells apart.
        answered = (
            fresh is not None
            and fresh.status == CommandStatus.PENDING
            and fresh.claimed_node_id is not None
            and receipt.claim_generation == fresh.claim_generation
            and receipt.node_id == fresh.claimed_node_id
            and await repo.claim_answered(
                conn, fresh.id, fresh.claim_generation, fresh.claimed_node_id
            )
        )
        guards = Guards(
            command_exists=fresh is not None,
            status=None if fresh is None else CommandStatus(fresh.status),
            claim_generation=None if fresh is None else fresh.claim_generation,
            claimed_node_id=None if fresh is None else fresh.claimed_node_id,
            claim_answered=answered,
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
        command_id=None if current is None else current.id,
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
    previous = None if updated is None or current is None else str(current.status)
    return AppliedReceipt(outcome, reason, updated, previous)


async def apply_receipts(
    conn: asyncpg.Connection,
    receipts: Sequence[tuple[str, CommandReceipt]],
    *,
    node_id: str,
    sent_timeout_s: float,
    retry_base_s: float = 2.0,
    retry_cap_s: float = 600.0,
) -> list[AppliedReceipt]:
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
    rows = {row.id: row for row in await repo.get_many(conn, once)} if once else {}
    planned: list[tuple[int, str, CommandReceipt, CommandRow, Any]] = []
    for index, (device_id, receipt) in enumerate(receipts):
        current = rows.get(receipt.command_id) if named[receipt.command_id] == 1 else None
        if current is None or current.device_id != device_id or not _may_apply(current, receipt):
            continue
        effect = receipt_effect(
            delivery=Delivery(current.delivery),
            current=CommandStatus(current.status),
            result=receipt.result,
            result_code=receipt.result_code,
            retry_count=current.retry_count,
        )
        planned.append((index, device_id, receipt, current, effect))
    updated: dict[int, CommandRow] = {}
    if planned:
        columns: list[list[Any]] = [[] for _ in range(13)]
        for _, _, receipt, current, effect in sorted(planned, key=lambda p: p[3].id):
            values = (
                current.id,
                receipt.claim_generation,
                receipt.node_id,
                current.status,
                effect.status.value,
                effect.result,
                effect.result_code,
                _raw_code(receipt),
                receipt.raw_ack,
                effect.terminal,
                1 if effect.retry else 0,
                retry_delay_s(current.retry_count, base_s=retry_base_s, cap_s=retry_cap_s),
                sent_timeout_s,
            )
            for column, value in zip(columns, values, strict=True):
                column.append(value)
        updated = {row.id: row for row in await repo.apply_receipts(conn, columns)}
    results: dict[int, AppliedReceipt] = {}
    audits: list[tuple[Any, ...]] = []
    events: list[tuple[str, CommandFinished]] = []
    logged: list[tuple[Any, ...]] = []
    for index, device_id, receipt, current, _effect in planned:
        row = updated.get(current.id)
        if row is None:
            continue  # the row moved since it was read: judged again, alone, below
        if row.status != current.status or row.retry_count != current.retry_count:
            audits.append(
                (row.id, DEVICE_ACTOR, f"receipt:{receipt.result.value}", current.status,
                 row.status, row.claim_generation, node_id)
            )  # fmt: skip
            if CommandStatus(row.status) in TERMINAL_STATUSES:
                events.append(
                    (str(row.id), CommandFinished(command=command_to_json(row), actor=DEVICE_ACTOR))
                )
        logged.append(
            (row.id, receipt.command_id, device_id, receipt.claim_generation, receipt.node_id,
             receipt.result.value, receipt.result_code, _raw_code(receipt), receipt.raw_ack,
             ReceiptOutcome.ACCEPTED.value, None, node_id)
        )  # fmt: skip
        results[index] = AppliedReceipt(ReceiptOutcome.ACCEPTED, None, row, str(current.status))
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


def _may_apply(current: CommandRow | None, receipt: CommandReceipt) -> bool:
    """The four guards, read from the row: the same claim, and still open; and a result code
    the command's standard field may hold (the receipt keeps any other, as sent)."""
    return (
        is_standard_result_code(receipt.result_code)
        and current is not None
        and receipt.claim_generation is not None
        and receipt.claim_generation == current.claim_generation
        and receipt.node_id is not None
        and receipt.node_id == current.claimed_node_id
        and CommandStatus(current.status) in (CommandStatus.CLAIMED, CommandStatus.SENT)
    )


class ReceiptApplier:
    """Applies command receipts in the ingest transaction (so the PUBACK follows the commit),
    and counts them once that transaction has committed (:meth:`committed`)."""

    def __init__(self, *, node_id: str, sent_timeout_s: float, metrics: Metrics | None) -> None:
        self.node_id = node_id
        self.sent_timeout_s = sent_timeout_s
        self.metrics = metrics
        self.command_metrics = None if metrics is None else CommandMetrics.of(metrics.registry)

    async def apply(
        self, conn: asyncpg.Connection, receipts: Sequence[tuple[str, CommandReceipt]]
    ) -> tuple[AppliedReceipt, ...]:
        """The receipts applied in the caller's transaction; what they did, for
        :meth:`committed`. Nothing is counted here: a transaction rolled back and retried (a
        lost race, the database away, a poisoned message beside them) applies them again."""
        # One batch: a few statements for all of them (apply_receipts).
        return tuple(
            await apply_receipts(
                conn, receipts, node_id=self.node_id, sent_timeout_s=self.sent_timeout_s
            )
        )

    def committed(self, batch: Sequence[AppliedReceipt]) -> None:
        """After the commit of ``batch``'s transaction (never after a rollback): each receipt
        by its outcome, each status it moved, and the latency of each command it finished. So
        per pair the transitions counted and the audit rows agree."""
        metrics, counted = self.metrics, self.command_metrics
        if metrics is None or counted is None:
            return
        for applied in batch:
            row, before = applied.command, applied.previous_status
            if row is not None and before is not None and row.status != before:
                metrics.count_command(before, row.status)
        count_receipts(counted, batch)


def count_receipts(counted: CommandMetrics, batch: Sequence[AppliedReceipt]) -> None:
    """After the commit that kept ``batch``'s receipt rows (never after a rollback): each
    receipt by its outcome, and the latency of each command it finished. Every receipt row is
    counted, a device's and the node's own (the ack window's ``TIMEOUT``: the reaper's pass)."""
    for applied in batch:
        reason = "" if applied.reason is None else applied.reason.value
        counted.command_receipts.labels(applied.outcome.value, reason).inc()
        row, before = applied.command, applied.previous_status
        moved = row is not None and before is not None and row.status != before
        if moved and row is not None and row.finished_at and row.claimed_at:
            latency = (row.finished_at - row.claimed_at).total_seconds()
            counted.command_latency.observe(max(latency, 0.0))
