"""A campaign's downlink the broker acknowledged while the database was away (a restart, a
failover) is SENT once the database is back: not left CLAIMED to lapse, reclaimed (blaming the
node) and sent to the device a second time.

A real daemon, its database behind a PostgreSQL-reading proxy (tests/support/pg_cut.py): the
broker acknowledges the downlink, and the connections are cut when the daemon sends the SENT
write that PUBACK asks for, until the daemon has tried again.
"""

from __future__ import annotations

import asyncpg

from gateway.commands.campaigns import CampaignRequest, CampaignService, Targets
from gateway.domain.command import Delivery
from storage.commands import MARK_SENT_MANY
from storage.pool import create_pool
from tests.support.daemon import make_config, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.pg_cut import PgCut, Statement
from tests.support.waiting import wait_until

# A short lease, so that a claim left CLAIMED lapses (and is reclaimed) within the test; the
# ack window far off, so that the SENT command waits for its (sleeping) device.
COMMANDS = "[commands]\nlease_s = 4\nreaper_interval_s = 0.5\nack_window_s = 600\n"


async def test_a_downlink_acknowledged_while_the_database_was_away_is_sent_once(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    database = proxy_for(db_dsn)
    await database.start()
    cut = PgCut(database)
    # The PUBACK's SENT write, the broker having acknowledged the downlink: it never reaches
    # PostgreSQL.
    cut.arm(Statement(MARK_SENT_MANY), at="sent")
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
            campaign_id = created.campaign.id

            seen: list[asyncpg.Record] = []

            async def settled() -> bool:
                async with pool.acquire() as conn:
                    row = await conn.fetchrow(
                        "SELECT * FROM command WHERE campaign_id = $1", campaign_id
                    )
                assert row is not None
                seen.append(row)
                # SENT by the first claim, or reclaimed (and claimed again) after its lease.
                return bool(row["status"] == "SENT" or row["reclaim_count"] > 0)

            await cut.outage()
            await wait_until(settled, timeout=30)
            row = seen[-1]
            assert (row["status"], row["claim_generation"], row["reclaim_count"]) == (
                "SENT", 1, 0,
            ), dict(row)  # fmt: skip
            async with pool.acquire() as conn:
                claims = await conn.fetchval(
                    "SELECT count(*) FROM command_audit WHERE command_id = $1 AND action = 'claim'",
                    row["id"],
                )
            assert claims == 1  # published once
    finally:
        await pool.close()
        await database.stop()
