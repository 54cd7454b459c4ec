"""A device's receipt that comes after the node's own ack-window TIMEOUT answered its claim
(docs/commands.md, "Reaper"): kept as ``duplicated``, the command untouched, for a realtime
command (failed by that TIMEOUT) and a deferrable one (sent back for its retry, and after the
retry's claim)."""

from __future__ import annotations

import asyncpg

from gateway.commands.lifecycle import mark_sent
from gateway.commands.reaper import reap
from gateway.domain.command import Delivery, ReceiptOutcome
from tests.integration.services.test_commands import (
    SENT_TIMEOUT_S,
    _claim,
    _create,
    _receipt,
    _row,
)


async def _sent_past_the_ack_window(db: asyncpg.Connection) -> None:
    for row in await _claim(db, "n"):
        await mark_sent(db, row, node_id="n", sent_timeout_s=SENT_TIMEOUT_S)
    await db.execute("UPDATE command SET sent_at = now() - interval '1 minute'")
    report = await reap(db, node_id="n", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S)
    assert len(report.timed_out_receipts) == 2


async def test_a_receipt_after_the_nodes_own_timeout_is_a_duplicate(
    db: asyncpg.Connection,
) -> None:
    realtime = await _create(db, device="d1")
    deferrable = await _create(db, device="d2", delivery=Delivery.DEFERRABLE)
    await _sent_past_the_ack_window(db)
    failed = await _row(db, realtime)
    waiting = await _row(db, deferrable)
    assert (failed.status, waiting.status) == ("FAILED", "PENDING")

    # The device did carry them out; its receipts come late (a broker that held them).
    assert await _receipt(db, realtime, generation=1, node="n") == (
        ReceiptOutcome.DUPLICATED, None,
    )  # fmt: skip
    assert await _receipt(db, deferrable, generation=1, node="n", device="d2") == (
        ReceiptOutcome.DUPLICATED, None,
    )  # fmt: skip
    assert await _row(db, realtime) == failed
    assert await _row(db, deferrable) == waiting

    # After the retry's claim, the first claim's receipt is an older generation's.
    await db.execute("UPDATE command SET next_attempt_at = now() WHERE id = $1", deferrable)
    (again,) = await _claim(db, "n")
    assert again.claim_generation == 2
    assert await _receipt(db, deferrable, generation=1, node="n", device="d2") == (
        ReceiptOutcome.DUPLICATED, None,
    )  # fmt: skip
    kept = await db.fetch(
        "SELECT command_id, result, outcome, reason, received_by FROM command_receipt ORDER BY id"
    )
    assert [tuple(r) for r in kept] == [
        (realtime, "TIMEOUT", "accepted", None, "n"),
        (deferrable, "TIMEOUT", "accepted", None, "n"),
        (realtime, "ACKED", "duplicated", None, "receiver"),
        (deferrable, "ACKED", "duplicated", None, "receiver"),
        (deferrable, "ACKED", "duplicated", None, "receiver"),
    ]
