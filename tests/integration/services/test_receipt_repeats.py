"""A device's receipt repeated (a QoS 1 redelivery, a device answering twice) after it sent a
deferrable command back to PENDING for a retry, against real PostgreSQL.

docs/commands.md: "Answering twice is harmless (`duplicated`)". The first answer (FAILED,
TIMEOUT or DEVICE_OFFLINE) requeues the command with its generation kept; the repeat used to be
judged as an answer to a lapsed claim, `rejected` `NOT_CLAIMED`, and counted among the
rejected receipts. A claim that did lapse (no answer, the reaper's reclaim) is still refused
`NOT_CLAIMED`.
"""

from __future__ import annotations

from datetime import timedelta

import asyncpg

from gateway.commands.reaper import reap
from gateway.commands.receipts import apply_receipts
from gateway.domain.command import Delivery, ReceiptOutcome, RejectReason
from protocol import CommandReceipt, ReceiptResult
from storage import commands as repo
from storage.commands import CommandRow
from tests.support.commands import new_command

SENT_TIMEOUT_S = 86400.0


async def _claimed(db: asyncpg.Connection, device: str) -> CommandRow:
    await new_command(
        db, device_id=device, name="set_config", params={"interval_s": 60},
        delivery=Delivery.DEFERRABLE, idempotency_key=None, actor="op:alice", node_id="api",
        expire_after_s=72 * 3600,
    )  # fmt: skip
    (row,) = await repo.claim_due(
        db, node_id="node-a", lease_s=30, limit=10, max_in_flight=1, actor="system:dispatcher"
    )
    return row


async def _answer(
    db: asyncpg.Connection, row: CommandRow, result: ReceiptResult
) -> tuple[ReceiptOutcome, RejectReason | None]:
    receipt = CommandReceipt(
        command_id=row.id, claim_generation=row.claim_generation, node_id="node-a",
        result=result, result_code=3 if result is ReceiptResult.FAILED else None,
    )  # fmt: skip
    async with db.transaction():  # as the ingest applies a batch
        (applied,) = await apply_receipts(
            db, [(row.device_id, receipt)], node_id="receiver", sent_timeout_s=SENT_TIMEOUT_S
        )
    return applied.outcome, applied.reason


async def test_a_repeated_retrying_answer_is_a_duplicate_not_a_rejection(
    db: asyncpg.Connection,
) -> None:
    for result in (ReceiptResult.FAILED, ReceiptResult.DEVICE_OFFLINE, ReceiptResult.TIMEOUT):
        row = await _claimed(db, f"dev-{result.value.lower()}")
        assert await _answer(db, row, result) == (ReceiptOutcome.ACCEPTED, None)
        requeued = await repo.get(db, row.id)
        assert requeued is not None
        assert (requeued.status, requeued.retry_count) == ("PENDING", 1)
        # The same answer again: harmless, and said to be so.
        assert await _answer(db, row, result) == (ReceiptOutcome.DUPLICATED, None), result
        assert await repo.get(db, row.id) == requeued  # untouched
        outcomes = [r["outcome"] for r in await repo.receipts_of(db, row.id)]
        assert outcomes == ["accepted", "duplicated"]


async def test_an_answer_to_a_lapsed_claim_is_still_not_claimed(db: asyncpg.Connection) -> None:
    row = await _claimed(db, "dev-lapsed")
    await db.execute(
        "UPDATE command SET lease_expire_at = now() - $2::interval WHERE id = $1",
        row.id,
        timedelta(seconds=1),
    )
    report = await reap(db, node_id="reaper", ack_window_s=0, sent_timeout_s=SENT_TIMEOUT_S)
    assert report.reclaimed == [row.id]
    assert await _answer(db, row, ReceiptResult.FAILED) == (
        ReceiptOutcome.REJECTED, RejectReason.NOT_CLAIMED,
    )  # fmt: skip
