"""A node with [[ingest.mappings]] reads its claimed commands' device mappings before it
publishes them; the database lost right then (a restart, a failover), nothing was published.
Those commands go back to PENDING at once when the database is back (not a reclaim: no node
went silent), instead of waiting out their lease and being reclaimed against the node
(`reclaim_count`, the `command-reclaims` alarm).

A real daemon, its database behind a PostgreSQL-reading proxy (tests/support/pg_cut.py): the
claim that takes the campaign's command commits (its COMMIT answered), and the connections are
cut when the batch sends its read of the device mappings, until the daemon has tried again.
"""

from __future__ import annotations

from storage.ingest import DEVICE_MAPPINGS
from tests.support.campaign_cut import campaign_through_a_cut, outcome
from tests.support.mosquitto import Mosquitto
from tests.support.pg_cut import Statement

# The lease far longer than the test's deadline: a claim left to lapse is seen as never sent.
COMMANDS = (
    "[commands]\nlease_s = 120\nreaper_interval_s = 0.5\nack_window_s = 600\n"
    '[[ingest.mappings]]\nname = "tasmota"\nprofile = "tasmota"\n'
)


async def test_claims_whose_mappings_could_not_be_read_are_released_not_left_to_lapse(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    # The batch's read of its device mappings, the claim committed and answered: it never
    # reaches PostgreSQL.
    async with campaign_through_a_cut(
        db_dsn, mosquitto, Statement(DEVICE_MAPPINGS), at="sent", extra=COMMANDS
    ) as rig:
        await rig.cut.outage()
        row = await rig.command_once(lambda row: bool(row["status"] == "SENT"))
        assert outcome(row) == ("SENT", 2, 0), dict(row)
        assert await rig.trail(row["id"]) == [
            ("create", 0), ("claim", 1), ("release", 1), ("claim", 2), ("sent", 2),
        ]  # fmt: skip
