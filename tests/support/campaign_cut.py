"""A campaign's one command, sent by a real daemon whose database is cut at a chosen statement.

The campaign audit tests (tests/integration/acceptance/test_camp_audit_*.py) share this setup:
the daemon (node ``node-a``) reaches its database through a PostgreSQL-reading proxy
(tests/support/pg_cut.py) armed at the statements the test names, and a campaign of one
REALTIME command to ``sleepy-1`` is created once the daemon runs. Each test then waits for the
outage (``rig.cut.outage()``), reads how its command settled and asserts on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

import asyncpg

from gateway.commands.campaigns import CampaignRequest, CampaignService, Targets
from gateway.domain.command import Delivery
from storage.pool import create_pool
from tests.support.daemon import make_config, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.pg_cut import PgCut, Statement
from tests.support.waiting import wait_until

# How long a test waits for its command to settle once the database is back.
SETTLE_S = 30.0


def outcome(row: asyncpg.Record) -> tuple[str, int, int]:
    """A command row's status, claim generation and reclaim count."""
    return row["status"], row["claim_generation"], row["reclaim_count"]


@dataclass
class CampaignCut:
    cut: PgCut
    pool: asyncpg.Pool  # straight to the database, not through the cut
    campaign_id: int

    async def command_once(self, settled: Callable[[asyncpg.Record], bool]) -> asyncpg.Record:
        """The campaign's command row once ``settled(row)``, or as last seen at the deadline
        (the test's assertions on it then say what it was)."""
        seen: list[asyncpg.Record] = []

        async def done() -> bool:
            async with self.pool.acquire() as conn:
                row = await conn.fetchrow(
                    "SELECT * FROM command WHERE campaign_id = $1", self.campaign_id
                )
            assert row is not None
            seen.append(row)
            return settled(row)

        with contextlib.suppress(AssertionError):  # the status is said by the test
            await wait_until(done, timeout=SETTLE_S)
        return seen[-1]

    async def trail(self, command_id: int) -> list[tuple[str, int]]:
        """The command's audit trail: (action, claim generation), oldest first."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT action, claim_generation FROM command_audit WHERE command_id = $1"
                " ORDER BY id",
                command_id,
            )
        return [(r["action"], r["claim_generation"]) for r in rows]


@contextlib.asynccontextmanager
async def campaign_through_a_cut(
    db_dsn: str,
    mosquitto: Mosquitto,
    *steps: Statement,
    at: Literal["sent", "answered"],
    extra: str,
    mqtt_extra: str = "",
    name: str = "reboot",
    params: dict[str, object] | None = None,
) -> AsyncIterator[CampaignCut]:
    """A daemon on ``db_dsn`` through a proxy cut at ``steps`` (``PgCut.arm``), its config's
    ``extra`` and ``mqtt_extra`` added, and a campaign ``name`` of one command to sleepy-1."""
    database = proxy_for(db_dsn)
    await database.start()
    cut = PgCut(database)
    cut.arm(*steps, at=at)
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    try:
        config = make_config(
            dsn=through(db_dsn, database), mqtt_port=mosquitto.port, node_id="node-a",
            extra=extra, mqtt_extra=mqtt_extra,
        )  # fmt: skip
        async with running_daemon(config):
            request = CampaignRequest(
                name=name, params=params or {}, delivery=Delivery.REALTIME,
                targets=Targets(devices=("sleepy-1",)), per_minute=None, abort=None,
                idempotency_key=None,
            )  # fmt: skip
            created = await CampaignService(pool, "api", 3600.0).create(request, actor="op")
            yield CampaignCut(cut, pool, created.campaign.id)
    finally:
        await pool.close()
        await database.stop()
