"""A campaign's downlink the broker acknowledged while the database was away (a restart, a
failover) is SENT once the database is back: not left CLAIMED to lapse, reclaimed (blaming the
node) and sent to the device a second time.

A real daemon, its database behind a PostgreSQL-reading proxy (tests/support/pg_cut.py): the
broker acknowledges the downlink, and the connections are cut when the daemon sends the SENT
write that PUBACK asks for, until the daemon has tried again.
"""

from __future__ import annotations

from storage.commands import MARK_SENT_MANY
from tests.support.campaign_cut import campaign_through_a_cut, outcome
from tests.support.mosquitto import Mosquitto
from tests.support.pg_cut import Statement

# A short lease, so that a claim left CLAIMED lapses (and is reclaimed) within the test; the
# ack window far off, so that the SENT command waits for its (sleeping) device.
COMMANDS = "[commands]\nlease_s = 4\nreaper_interval_s = 0.5\nack_window_s = 600\n"


async def test_a_downlink_acknowledged_while_the_database_was_away_is_sent_once(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    # The PUBACK's SENT write, the broker having acknowledged the downlink: it never reaches
    # PostgreSQL.
    async with campaign_through_a_cut(
        db_dsn, mosquitto, Statement(MARK_SENT_MANY), at="sent", extra=COMMANDS
    ) as rig:
        await rig.cut.outage()
        # SENT by the first claim, or reclaimed (and claimed again) after its lease.
        row = await rig.command_once(
            lambda row: bool(row["status"] == "SENT" or row["reclaim_count"] > 0)
        )
        assert outcome(row) == ("SENT", 1, 0), dict(row)
        async with rig.pool.acquire() as conn:
            claims = await conn.fetchval(
                "SELECT count(*) FROM command_audit WHERE command_id = $1 AND action = 'claim'",
                row["id"],
            )
        assert claims == 1  # published once
