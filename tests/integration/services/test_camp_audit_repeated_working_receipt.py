"""A device's SENT receipt ("received, working on it") repeated (a QoS 1 redelivery after its
connection flapped, a device answering twice), against real PostgreSQL, as the ingest applies
receipts.

docs/commands.md: a repeat is `duplicated`, its command untouched ("Answering twice is
harmless"). A repeated SENT used to be `accepted` a second time (and a third...): counted again
among the accepted receipts, its raw fields written over the first's, while a repeated ACKED or
FAILED was `duplicated`.
"""

from __future__ import annotations

import asyncpg

from gateway.commands.lifecycle import mark_sent
from gateway.commands.receipts import apply_receipts
from gateway.domain.command import Delivery, ReceiptOutcome, RejectReason
from protocol import CommandReceipt, ReceiptResult
from storage import commands as repo
from storage.commands import CommandRow
from tests.support.commands import new_command

SENT_TIMEOUT_S = 86400.0


async def _sent(db: asyncpg.Connection, device: str) -> CommandRow:
    await new_command(
        db, device_id=device, name="firmware_update", params={"image": "v2"},
        delivery=Delivery.REALTIME, idempotency_key=None, actor="op:alice", node_id="api",
        expire_after_s=72 * 3600,
    )  # fmt: skip
    (row,) = await repo.claim_due(
        db, node_id="node-a", lease_s=30, limit=10, max_in_flight=1, actor="system:dispatcher"
    )
    sent = await mark_sent(db, row, node_id="node-a", sent_timeout_s=SENT_TIMEOUT_S)
    assert sent is not None
    return sent


def _working(row: CommandRow, raw: str | None) -> CommandReceipt:
    return CommandReceipt(
        command_id=row.id, claim_generation=row.claim_generation, node_id="node-a",
        result=ReceiptResult.SENT, raw_ack=raw,
    )  # fmt: skip


async def _answer(
    db: asyncpg.Connection, rows: list[tuple[CommandRow, str | None]]
) -> list[tuple[ReceiptOutcome, RejectReason | None]]:
    receipts = [(row.device_id, _working(row, raw)) for row, raw in rows]
    async with db.transaction():  # as the ingest applies a batch
        applied = await apply_receipts(
            db, receipts, node_id="receiver", sent_timeout_s=SENT_TIMEOUT_S
        )
    return [(a.outcome, a.reason) for a in applied]


async def test_a_repeated_working_receipt_is_a_duplicate_and_changes_nothing(
    db: asyncpg.Connection,
) -> None:
    row = await _sent(db, "dev-1")
    assert await _answer(db, [(row, "working 1")]) == [(ReceiptOutcome.ACCEPTED, None)]
    first = await repo.get(db, row.id)
    assert first is not None
    assert (first.status, first.raw_ack) == ("SENT", "working 1")
    # Redelivered later, in a batch of its own, and twice in one batch.
    assert await _answer(db, [(row, "working 2")]) == [(ReceiptOutcome.DUPLICATED, None)]
    assert await _answer(db, [(row, "working 3"), (row, "working 4")]) == [
        (ReceiptOutcome.DUPLICATED, None),
        (ReceiptOutcome.DUPLICATED, None),
    ]
    assert await repo.get(db, row.id) == first  # untouched
    outcomes = [r["outcome"] for r in await repo.receipts_of(db, row.id)]
    assert outcomes == ["accepted", "duplicated", "duplicated", "duplicated"]


async def test_the_first_working_receipt_of_each_claim_is_still_accepted(
    db: asyncpg.Connection,
) -> None:
    """Twice in the batch that brings the first: the first accepted, the second a repeat."""
    row = await _sent(db, "dev-2")
    assert await _answer(db, [(row, "working"), (row, "working")]) == [
        (ReceiptOutcome.ACCEPTED, None),
        (ReceiptOutcome.DUPLICATED, None),
    ]
    # The device's final answer after it is applied as ever.
    receipt = CommandReceipt(
        command_id=row.id, claim_generation=row.claim_generation, node_id="node-a",
        result=ReceiptResult.ACKED, result_code=0,
    )  # fmt: skip
    async with db.transaction():
        (applied,) = await apply_receipts(
            db, [(row.device_id, receipt)], node_id="receiver", sent_timeout_s=SENT_TIMEOUT_S
        )
    assert applied.outcome is ReceiptOutcome.ACCEPTED
    done = await repo.get(db, row.id)
    assert done is not None
    assert done.status == "ACKED"
