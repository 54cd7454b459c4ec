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

from storage.commands import FAIL_UNSENDABLE
from tests.support.campaign_cut import campaign_through_a_cut, outcome
from tests.support.mosquitto import Mosquitto
from tests.support.pg_cut import Statement

# The lease far longer than the test's deadline: a claim left to lapse is seen as never sent.
COMMANDS = "[commands]\nlease_s = 120\nreaper_interval_s = 0.5\nack_window_s = 600\n"


async def test_an_unsendable_downlink_fails_its_first_claim_through_a_database_outage(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    # The claim's FAILED write (the broker refused the downlink): it never reaches PostgreSQL.
    async with campaign_through_a_cut(
        db_dsn, mosquitto, Statement(FAIL_UNSENDABLE), at="sent", extra=COMMANDS,
        mqtt_extra="max_packet_size = 512", name="set_config", params={"blob": "x" * 2000},
    ) as rig:  # fmt: skip
        await rig.cut.outage()
        row = await rig.command_once(lambda row: bool(row["status"] == "FAILED"))
        assert outcome(row) == ("FAILED", 1, 0), dict(row)
        assert row["raw_result_code"] == "PACKET_TOO_LARGE"
        assert await rig.trail(row["id"]) == [
            ("create", 0), ("claim", 1), ("unsendable", 1),
        ]  # fmt: skip
