"""Two nodes' reapers judging the same silent command at once, against real PostgreSQL.

docs/commands.md: the ack window's TIMEOUT is the node's own receipt, written by whichever node
passes first, once. The second node's pass used to wait for the first one's lock, then write a
TIMEOUT receipt of its own, kept and counted as the device's `duplicated` answer: with two or
three nodes, most silent commands showed two or three TIMEOUT receipts, and the duplicated
receipts (what a device answering twice is watched by) counted the nodes' race.
"""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.commands.lifecycle import mark_sent
from gateway.commands.reaper import reap
from gateway.domain.command import Delivery
from storage import commands as repo
from tests.support.commands import new_command
from tests.support.waiting import wait_until

SENT_TIMEOUT_S = 86400.0


async def test_a_silent_command_gets_one_timeout_receipt_when_two_reapers_meet(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    created = await new_command(
        db, device_id="silent-1", name="reboot", params={}, delivery=Delivery.REALTIME,
        idempotency_key=None, actor="op", node_id="api", expire_after_s=72 * 3600,
    )  # fmt: skip
    (claimed,) = await repo.claim_due(
        db, node_id="node-a", lease_s=30, limit=10, max_in_flight=1, actor="system:dispatcher"
    )
    assert await mark_sent(db, claimed, node_id="node-a", sent_timeout_s=SENT_TIMEOUT_S)
    await db.execute("UPDATE command SET sent_at = now() - interval '1 minute'")
    first = await asyncpg.connect(db_dsn)
    second = await asyncpg.connect(db_dsn)
    try:
        one = first.transaction()
        await one.start()
        report_a = await reap(
            first, node_id="node-a", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S
        )
        assert report_a.timed_out_receipts == [created.command.id]

        async def pass_b() -> list[int]:
            async with second.transaction():
                report = await reap(
                    second, node_id="node-b", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S
                )
            return report.timed_out_receipts

        b = asyncio.create_task(pass_b())

        async def b_waits_or_is_done() -> bool:
            if b.done():
                return True
            waiting = await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            )
            return bool(waiting)

        await wait_until(b_waits_or_is_done, timeout=10)
        await one.commit()
        assert await b == []
        receipts = await db.fetch(
            "SELECT result, outcome, received_by FROM command_receipt WHERE command_id = $1",
            created.command.id,
        )
        assert [tuple(r) for r in receipts] == [("TIMEOUT", "accepted", "node-a")]
    finally:
        await first.close()
        await second.close()
