"""Campaigns against real PostgreSQL: the rollout limit enforced by the claim statement across
nodes, the abort exactly once with nodes racing, completion, and the settler's wake-up.

The rollout test drives the claim statement with explicit instants (the rollout clock): a
simulated minute in a second, no sleeps, with two nodes claiming at every instant.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from gateway.commands.campaigns import (
    CampaignRequest,
    CampaignService,
    CampaignSettler,
    Targets,
)
from gateway.commands.receipts import apply_receipt
from gateway.domain.campaign import AbortCriteria
from gateway.domain.command import Delivery
from protocol import CommandReceipt, ReceiptResult
from storage import commands as repo
from storage.commands import CommandRow, command_row
from tests.support.commands import new_command
from tests.support.waiting import wait_until

DISPATCHER = "system:dispatcher"


def _request(n: int, **fields: Any) -> CampaignRequest:
    base: dict[str, Any] = {
        "name": "reboot", "params": {}, "delivery": Delivery.REALTIME,
        "targets": Targets(devices=tuple(f"dev-{i:05d}" for i in range(n))),
        "per_minute": None, "abort": None, "idempotency_key": None,
    }  # fmt: skip
    base.update(fields)
    return CampaignRequest(**base)


async def _start(pool: asyncpg.Pool, n: int, **fields: Any) -> int:
    service = CampaignService(pool, "api", 3600.0)
    created = await service.create(_request(n, **fields), actor="api:console")
    return int(created.campaign.id)


async def _answer(
    conn: asyncpg.Connection, row: CommandRow, *, code: int, node: str = "n1"
) -> None:
    async with conn.transaction():
        await apply_receipt(
            conn, device_id=row.device_id, node_id=node, sent_timeout_s=60,
            receipt=CommandReceipt(command_id=row.id, claim_generation=row.claim_generation,
                                   node_id=row.claimed_node_id, result=ReceiptResult.ACKED,
                                   result_code=code),
        )  # fmt: skip


@pytest.mark.parametrize("per_minute", [600])
async def test_rollout_is_honoured_across_two_nodes_within_ten_percent_over_a_minute(
    pool: asyncpg.Pool, per_minute: int
) -> None:
    campaign_id = await _start(pool, 2 * per_minute, per_minute=per_minute)
    async with pool.acquire() as conn:
        start = await conn.fetchval("SELECT rollout_at FROM campaign WHERE id = $1", campaign_id)
    step = timedelta(seconds=0.25)
    claims: list[tuple[float, str]] = []  # (seconds into the minute, node)
    single_claimed = False

    async def claim(node: str, at: Any) -> list[CommandRow]:
        async with pool.acquire() as conn:
            return await repo.claim_due(
                conn, node_id=node, lease_s=3600, limit=50, max_in_flight=1, actor=DISPATCHER,
                now=at,
            )  # fmt: skip

    for k in range(int(timedelta(minutes=1) / step)):
        at = start + k * step
        if k == 100:  # a command outside the campaign is never held back by its limit
            async with pool.acquire() as conn:
                await new_command(
                    conn, device_id="lone", name="ping", params={}, delivery=Delivery.REALTIME,
                    idempotency_key=None, actor="api:x", node_id="api", expire_after_s=60,
                )  # fmt: skip
        taken = await asyncio.gather(claim("n1", at), claim("n2", at))
        for node, rows in zip(("n1", "n2"), taken, strict=True):
            for row in rows:
                if row.campaign_id is None:
                    single_claimed = True
                else:
                    claims.append(((at - start).total_seconds(), node))
    assert single_claimed
    assert {node for _, node in claims} == {"n1", "n2"}  # both nodes took a share
    # Within 10 % of the limit over the minute (the bucket starts with one second's worth).
    assert per_minute * 0.9 <= len(claims) <= per_minute * 1.1, len(claims)
    # And no half minute holds more than half the limit plus the bucket's one second.
    burst = max(1.0, per_minute / 60)
    for begin in range(31):
        window = [t for t, _ in claims if begin <= t < begin + 30]
        assert len(window) <= per_minute / 2 + burst + 1, (begin, len(window))
    async with pool.acquire() as conn:
        claimed = await conn.fetchval(
            "SELECT count(*) FROM command WHERE campaign_id = $1 AND status = 'CLAIMED'",
            campaign_id,
        )
        audits = await conn.fetchval(
            "SELECT count(*) FROM command_audit a JOIN command c ON c.id = a.command_id"
            " WHERE c.campaign_id = $1 AND a.action = 'claim'",
            campaign_id,
        )
    assert claimed == audits == len(claims)


async def test_rollout_claims_racing_at_one_instant_never_overspend(pool: asyncpg.Pool) -> None:
    """Four claims (the pool's size) released at once at one instant: one bucket, spent once."""
    campaign_id = await _start(pool, 100, per_minute=60)  # one token a second, one held
    async with pool.acquire() as conn:
        start = await conn.fetchval("SELECT rollout_at FROM campaign WHERE id = $1", campaign_id)
    gate = asyncio.Barrier(4)  # released together once all four hold a connection

    async def claim(node: str) -> int:
        async with pool.acquire() as conn:
            await gate.wait()
            rows = await repo.claim_due(
                conn, node_id=node, lease_s=3600, limit=50, max_in_flight=1, actor=DISPATCHER,
                now=start + timedelta(seconds=5),
            )  # fmt: skip
            return len(rows)

    taken = await asyncio.gather(*(claim(f"n{i % 2}") for i in range(4)))
    assert sum(taken) == 1  # a bucket holds at most one second's worth (here: one token)


async def test_abort_happens_exactly_once_with_two_nodes_racing(pool: asyncpg.Pool) -> None:
    campaign_id = await _start(pool, 100, abort=AbortCriteria(failure_ratio=0.2, min_finished=50))
    async with pool.acquire() as conn:
        claimed = await repo.claim_due(
            conn, node_id="n1", lease_s=3600, limit=100, max_in_flight=1, actor=DISPATCHER
        )
        assert len(claimed) == 100
        # 40 ACKED, then 9 FAILED: 49 finished, below min_finished; nothing happens yet.
        for row in claimed[:40]:
            await _answer(conn, row, code=0)
        for row in claimed[40:49]:
            await _answer(conn, row, code=3)
    nodes = [CampaignService(pool, f"node-{i}", 3600.0) for i in range(2)]
    assert await nodes[0].settle(campaign_id) is None
    async with pool.acquire() as conn:
        await _answer(conn, claimed[49], code=3)  # 50 finished, 10 failed: 0.2 reached
    await conn_events_cleared(pool)

    gate = asyncio.Barrier(8)

    async def settle(service: CampaignService) -> Any:
        await gate.wait()  # all eight released at once
        return await service.settle(campaign_id)

    results = await asyncio.gather(*(settle(nodes[i % 2]) for i in range(8)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert winners[0].status == "ABORTED"
    assert "10 of 50" in winners[0].status_reason
    async with pool.acquire() as conn:
        statuses = await conn.fetch(
            "SELECT status, count(*) AS n FROM command WHERE campaign_id = $1 GROUP BY status",
            campaign_id,
        )
        assert {r["status"]: r["n"] for r in statuses} == {
            "ACKED": 40, "FAILED": 10, "CANCELLED": 50,
        }  # fmt: skip
        trail = await conn.fetch(
            "SELECT action, from_status, to_status, actor FROM campaign_audit"
            " WHERE campaign_id = $1 ORDER BY id",
            campaign_id,
        )
        assert [tuple(t) for t in trail] == [
            ("create", None, "RUNNING", "api:console"),
            ("abort", "RUNNING", "ABORTED", "system:campaigns"),
        ]
        events = await conn.fetch("SELECT event_type, count(*) AS n FROM outbox_event"
                                  " GROUP BY event_type")  # fmt: skip
        assert {e["event_type"]: e["n"] for e in events} == {
            "campaign.aborted": 1, "command.finished": 50,
        }  # fmt: skip
        cancels = await conn.fetchval(
            "SELECT count(*) FROM command_audit WHERE action = 'campaign-abort'"
        )
        assert cancels == 50
    # Settling again changes nothing.
    assert await nodes[1].settle(campaign_id) is None


async def conn_events_cleared(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await conn.execute("DELETE FROM outbox_event")


async def test_the_settler_completes_a_campaign_when_its_last_commands_finish_on_two_nodes(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    campaign_id = await _start(pool, 6)
    stop = asyncio.Event()
    settlers = [
        CampaignSettler(CampaignService(pool, f"node-{i}", 3600.0), dsn=db_dsn, poll_s=60.0)
        for i in range(2)
    ]
    loops = [asyncio.create_task(s.run(stop)) for s in settlers]
    try:
        async with pool.acquire() as conn:
            claimed = await repo.claim_due(
                conn, node_id="n1", lease_s=3600, limit=10, max_in_flight=1, actor=DISPATCHER
            )
            for row in claimed[:4]:
                await _answer(conn, row, code=0)
        # The last two finish in two transactions that commit together.
        async with pool.acquire() as a, pool.acquire() as b:
            ta, tb = a.transaction(), b.transaction()
            await ta.start()
            await tb.start()
            for conn, row in ((a, claimed[4]), (b, claimed[5])):
                await apply_receipt(
                    conn, device_id=row.device_id, node_id="n1", sent_timeout_s=60,
                    receipt=CommandReceipt(command_id=row.id, claim_generation=1,
                                           node_id="n1", result=ReceiptResult.ACKED,
                                           result_code=0),
                )  # fmt: skip
            await asyncio.gather(ta.commit(), tb.commit())

        async def status() -> str:
            async with pool.acquire() as conn:
                return str(
                    await conn.fetchval("SELECT status FROM campaign WHERE id = $1", campaign_id)
                )

        async def completed() -> bool:
            return await status() == "COMPLETED"

        # Woken by PostgreSQL's notification (the poll is a minute away).
        await wait_until(completed, timeout=20)
    finally:
        stop.set()
        await asyncio.gather(*loops)
    async with pool.acquire() as conn:
        trail = await conn.fetch(
            "SELECT action, to_status FROM campaign_audit WHERE campaign_id = $1 ORDER BY id",
            campaign_id,
        )
        assert [tuple(t) for t in trail] == [("create", "RUNNING"), ("complete", "COMPLETED")]
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM outbox_event WHERE event_type = 'campaign.completed'"
            )
            == 1
        )


async def _analyzed(pool: asyncpg.Pool) -> int:
    count = await pool.fetchval(
        "SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'command'"
    )
    return int(count)


async def test_a_large_campaign_refreshes_the_command_statistics_and_a_small_one_not(
    pool: asyncpg.Pool,
) -> None:
    """The bulk insert of a campaign is followed by ANALYZE (claims planned from statistics
    that had not seen it sorted every pending row); a small campaign leaves it to autovacuum."""
    before = await _analyzed(pool)
    await _start(pool, 10)
    assert await _analyzed(pool) == before
    await _start(pool, 1000)
    await wait_until(lambda: _more(pool, before), timeout=10, message="command analyzed")
    planned = await pool.fetchval("SELECT reltuples FROM pg_class WHERE relname = 'command'")
    assert planned >= 1000  # the statistics count the campaign's rows


async def _more(pool: asyncpg.Pool, before: int) -> bool:
    return await _analyzed(pool) > before


async def test_the_settler_neither_locks_nor_counts_a_campaign_that_can_only_complete_later(
    pool: asyncpg.Pool,
) -> None:
    """No abort criteria and a command still open: the settler passes it by without its lock
    (held here by another transaction, which would make a locking settler wait)."""
    campaign_id = await _start(pool, 3)
    service = CampaignService(pool, "n1", 3600.0)
    async with pool.acquire() as holder, holder.transaction():
        await holder.execute("SELECT 1 FROM campaign WHERE id = $1 FOR UPDATE", campaign_id)
        assert await asyncio.wait_for(service.settle_running(), timeout=10) == 0
    rows = await pool.fetch("SELECT * FROM command WHERE campaign_id = $1", campaign_id)
    async with pool.acquire() as conn:
        for row in rows:  # all three finish: now it completes, on the next pass
            async with conn.transaction():
                claimed = await conn.fetchrow(
                    "UPDATE command SET status = 'CLAIMED', claim_generation = 1,"
                    " claimed_node_id = 'n1', claimed_at = now(),"
                    " lease_expire_at = now() + interval '1 minute' WHERE id = $1 RETURNING *",
                    row["id"],
                )
            await _answer(conn, command_row(claimed), code=0)
    assert await service.settle_running() == 1
    status = await pool.fetchval("SELECT status FROM campaign WHERE id = $1", campaign_id)
    assert status == "COMPLETED"
