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

from storage.commands import CLAIM_DUE
from tests.support.campaign_cut import campaign_through_a_cut, outcome
from tests.support.mosquitto import Mosquitto
from tests.support.pg_cut import Statement

# The lease far longer than the test's deadline: a claim left to lapse is seen as never sent.
COMMANDS = "[commands]\nlease_s = 120\nreaper_interval_s = 0.5\nack_window_s = 600\n"


async def test_a_claim_whose_commit_answer_was_lost_is_released_not_left_to_lapse(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    # The claim that takes the command (it answers a row), then its COMMIT: PostgreSQL runs it,
    # its answer never reaches the daemon.
    cut_at = (Statement(CLAIM_DUE, rows=True), Statement("COMMIT"))
    async with campaign_through_a_cut(
        db_dsn, mosquitto, *cut_at, at="answered", extra=COMMANDS
    ) as rig:
        await rig.cut.outage()
        assert rig.cut.statement == "COMMIT;"
        row = await rig.command_once(lambda row: bool(row["status"] == "SENT"))
        assert outcome(row) == ("SENT", 2, 0), dict(row)
        assert await rig.trail(row["id"]) == [
            ("create", 0), ("claim", 1), ("release", 1), ("claim", 2), ("sent", 2),
        ]  # fmt: skip
