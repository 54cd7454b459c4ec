"""A paced campaign's commands expire counted from when its rollout lets them go out, against
real PostgreSQL, the real clock and the real claim and reaper statements.

Every command of a campaign used to expire ``expire_after_s`` after the campaign's creation.
With a rollout limit, the last of N targets cannot leave PENDING before about N / per_minute
minutes: a campaign whose rollout outlasts that window (10 a minute to 50,000 devices takes 83
hours, against 72) had its tail expire unsent, each one a TIMEOUT counted by the abort criteria
as a failure: the campaign was ABORTED for failures no device had. Here in seconds: one command
a second, six targets, commands that expire after 3 s.
"""

from __future__ import annotations

import asyncpg

from gateway.commands.campaigns import CampaignRequest, CampaignService, Targets
from gateway.commands.reaper import reap
from gateway.commands.receipts import apply_receipt
from gateway.domain.campaign import AbortCriteria
from gateway.domain.command import Delivery
from protocol import CommandReceipt, ReceiptResult
from storage import commands as repo
from tests.support.waiting import wait_until

EXPIRE_AFTER_S = 3.0


async def test_a_paced_campaign_slower_than_the_expiry_window_still_reaches_every_target(
    pool: asyncpg.Pool,
) -> None:
    service = CampaignService(pool, "api", EXPIRE_AFTER_S)
    created = await service.create(
        CampaignRequest(
            name="set_config", params={"interval_s": 60}, delivery=Delivery.REALTIME,
            targets=Targets(devices=tuple(f"dev-{i}" for i in range(6))),
            per_minute=60, abort=AbortCriteria(failure_ratio=0.2, min_finished=1),
            idempotency_key=None,
        ),
        actor="api:ops",
    )  # fmt: skip
    campaign_id = created.campaign.id

    async def step() -> bool:
        """One dispatcher claim (the real rollout clock), each claim answered at once by its
        device; then one reaper pass and one settler pass. Done once the campaign closed."""
        async with pool.acquire() as conn:
            for row in await repo.claim_due(
                conn, node_id="n1", lease_s=60, limit=10, max_in_flight=1, actor="dispatcher"
            ):
                async with conn.transaction():
                    await apply_receipt(
                        conn, device_id=row.device_id, node_id="n1", sent_timeout_s=60,
                        receipt=CommandReceipt(
                            command_id=row.id, claim_generation=row.claim_generation,
                            node_id="n1", result=ReceiptResult.ACKED, result_code=0,
                        ),
                    )  # fmt: skip
            async with conn.transaction():
                await reap(conn, node_id="n1", ack_window_s=0, sent_timeout_s=60)
        await service.settle(campaign_id)
        return (await service.get(campaign_id)).status != "RUNNING"

    await wait_until(step, timeout=30, interval=0.1, message="the campaign closed")
    closed = await service.get(campaign_id)
    assert closed.counts == {"ACKED": 6}, closed.counts
    assert closed.status == "COMPLETED", closed.status_reason
