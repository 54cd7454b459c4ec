"""A downlink the broker can never take (larger than its maximum packet size) fails its command
at once, whatever its delivery class. The database lost right then (a restart, a failover),
that FAILED write used to be given up: the claim waited out its lease, was reclaimed against
the node (`reclaim_count`, the `command-reclaims` alarm) and claimed again only to meet the same
refusal. It is tried again while the lease lasts: FAILED on its first claim, no reclaim.

A real daemon, its database behind a PostgreSQL-reading proxy (tests/support/pg_cut.py): the
connections are cut when the node sends the FAILED write of the refused downlink, until the
daemon has tried again.
"""

from __future__ import annotations

import contextlib

import asyncpg

from gateway.commands.campaigns import CampaignRequest, CampaignService, Targets
from gateway.domain.command import Delivery
from storage.commands import FAIL_UNSENDABLE
from storage.pool import create_pool
from tests.support.daemon import make_config, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.pg_cut import PgCut, Statement
from tests.support.waiting import wait_until

# The lease far longer than the test's deadline: a claim left to lapse is seen as never sent.
COMMANDS = "[commands]\nlease_s = 120\nreaper_interval_s = 0.5\nack_window_s = 600\n"


async def test_an_unsendable_downlink_fails_its_first_claim_through_a_database_outage(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    database = proxy_for(db_dsn)
    await database.start()
    cut = PgCut(database)
    # The claim's FAILED write (the broker refused the downlink): it never reaches PostgreSQL.
    cut.arm(Statement(FAIL_UNSENDABLE), at="sent")
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    try:
        config = make_config(
            dsn=through(db_dsn, database), mqtt_port=mosquitto.port, node_id="node-a",
            extra=COMMANDS, mqtt_extra="max_packet_size = 512",
        )  # fmt: skip
        async with running_daemon(config):
            request = CampaignRequest(
                name="set_config", params={"blob": "x" * 2000}, delivery=Delivery.REALTIME,
                targets=Targets(devices=("sleepy-1",)), per_minute=None, abort=None,
                idempotency_key=None,
            )  # fmt: skip
            created = await CampaignService(pool, "api", 3600.0).create(request, actor="op")
            seen: list[asyncpg.Record] = []

            async def failed() -> bool:
                async with pool.acquire() as conn:
                    row = await conn.fetchrow(
                        "SELECT * FROM command WHERE campaign_id = $1", created.campaign.id
                    )
                assert row is not None
                seen.append(row)
                return bool(row["status"] == "FAILED")

            await cut.outage()
            with contextlib.suppress(AssertionError):  # the status is said below
                await wait_until(failed, timeout=30)
            row = seen[-1]
            assert (row["status"], row["claim_generation"], row["reclaim_count"]) == (
                "FAILED", 1, 0,
            ), dict(row)  # fmt: skip
            assert row["raw_result_code"] == "PACKET_TOO_LARGE"
            async with pool.acquire() as conn:
                trail = await conn.fetch(
                    "SELECT action, claim_generation FROM command_audit WHERE command_id = $1"
                    " ORDER BY id",
                    row["id"],
                )
            assert [(t["action"], t["claim_generation"]) for t in trail] == [
                ("create", 0), ("claim", 1), ("unsendable", 1),
            ]  # fmt: skip
    finally:
        await pool.close()
        await database.stop()
