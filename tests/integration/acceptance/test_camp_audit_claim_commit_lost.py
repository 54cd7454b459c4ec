"""A claim whose COMMIT answer was lost with the database (a restart, a failover right then):
the claim committed, the node never learned it, and nothing was published. Its commands go back
to PENDING at once when the database is back (not a reclaim: no node went silent), instead of
waiting out their lease and being reclaimed against the node (`reclaim_count`, the
`command-reclaims` alarm).

A real daemon, its database behind a PostgreSQL-reading proxy (tests/support/pg_cut.py): the
COMMIT of the claim that takes the campaign's command reaches PostgreSQL, its answer never
reaches the daemon, and the connections are cut then, until the daemon has tried again.
"""

from __future__ import annotations

import contextlib

import asyncpg

from gateway.commands.campaigns import CampaignRequest, CampaignService, Targets
from gateway.domain.command import Delivery
from storage.commands import CLAIM_DUE
from storage.pool import create_pool
from tests.support.daemon import make_config, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.pg_cut import PgCut, Statement
from tests.support.waiting import wait_until

# The lease far longer than the test's deadline: a claim left to lapse is seen as never sent.
COMMANDS = "[commands]\nlease_s = 120\nreaper_interval_s = 0.5\nack_window_s = 600\n"


async def test_a_claim_whose_commit_answer_was_lost_is_released_not_left_to_lapse(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    database = proxy_for(db_dsn)
    await database.start()
    cut = PgCut(database)
    # The claim that takes the command (it answers a row), then its COMMIT: PostgreSQL runs it,
    # its answer never reaches the daemon.
    cut.arm(Statement(CLAIM_DUE, rows=True), Statement("COMMIT"), at="answered")
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    try:
        config = make_config(
            dsn=through(db_dsn, database), mqtt_port=mosquitto.port, node_id="node-a",
            extra=COMMANDS,
        )  # fmt: skip
        async with running_daemon(config):
            request = CampaignRequest(
                name="reboot", params={}, delivery=Delivery.REALTIME,
                targets=Targets(devices=("sleepy-1",)), per_minute=None, abort=None,
                idempotency_key=None,
            )  # fmt: skip
            created = await CampaignService(pool, "api", 3600.0).create(request, actor="op")
            seen: list[asyncpg.Record] = []

            async def sent() -> bool:
                async with pool.acquire() as conn:
                    row = await conn.fetchrow(
                        "SELECT * FROM command WHERE campaign_id = $1", created.campaign.id
                    )
                assert row is not None
                seen.append(row)
                return bool(row["status"] == "SENT")

            await cut.outage()
            assert cut.statement == "COMMIT;"
            with contextlib.suppress(AssertionError):  # the status is said below
                await wait_until(sent, timeout=30)
            row = seen[-1]
            assert (row["status"], row["claim_generation"], row["reclaim_count"]) == (
                "SENT", 2, 0,
            ), dict(row)  # fmt: skip
            async with pool.acquire() as conn:
                trail = await conn.fetch(
                    "SELECT action, claim_generation FROM command_audit WHERE command_id = $1"
                    " ORDER BY id",
                    row["id"],
                )
            assert [(t["action"], t["claim_generation"]) for t in trail] == [
                ("create", 0), ("claim", 1), ("release", 1), ("claim", 2), ("sent", 2),
            ]  # fmt: skip
    finally:
        await pool.close()
        await database.stop()
