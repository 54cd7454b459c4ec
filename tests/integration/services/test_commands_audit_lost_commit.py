"""A command or campaign creation whose COMMIT answer was lost: the API answers what
PostgreSQL did.

docs/commands.md: "If the transaction fails (the database unreachable), nothing of the batch is
written and every request in it gets the error (503)". A restart or a failover just after the
COMMIT reached PostgreSQL loses only its answer: the command is committed (and a realtime one is
dispatched to the device), and a 503 with "retry" has the operator create it a second time. The
creation asks, on a new connection, whether its transaction committed (as the ingest writer
does, docs/architecture.md step 5), and answers the command when it did.

The COMMIT's answer is lost as in tests/integration/services/test_ingest_lost_commit.py: a TCP
proxy lets the COMMIT through and swallows everything after it, and the connection is cut once
the commit is visible.
"""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.commands.campaigns import CampaignRequest, CampaignService, Targets
from gateway.commands.creator import CommandCreator, NewCommand
from gateway.domain.command import Delivery
from storage.pool import create_pool
from tests.integration.services.test_ingest_lost_commit import COMMIT, _lose_the_commit_answer
from tests.support.dsn import proxy_for, through
from tests.support.waiting import wait_until

COMMAND = NewCommand(
    device_id="dev-1",
    name="open-valve",
    params={"valve": 3},
    delivery=Delivery.REALTIME,
    idempotency_key=None,
    actor="operator",
)


async def test_a_creation_committed_before_its_answer_was_lost_answers_the_command(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    pool = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
    creator = CommandCreator(pool, "node-a", 3600)
    _lose_the_commit_answer(proxy)
    try:
        creating = asyncio.create_task(creator.create(COMMAND))

        async def committed() -> bool:
            return bool(await db.fetchval("SELECT count(*) FROM command"))

        await wait_until(committed, timeout=30, message="the command committed")
        proxy.from_client = None
        await proxy.cut()
        proxy.swallowing = False
        await proxy.resume()
        async with asyncio.timeout(30):
            done = await asyncio.gather(creating, return_exceptions=True)
    finally:
        await pool.close()
        await proxy.stop()
    stored = await db.fetch("SELECT id FROM command")
    assert len(stored) == 1
    outcome = done[0]
    # Not "the database is not reachable; retry": the command exists and goes to the device.
    assert not isinstance(outcome, BaseException), repr(outcome)
    assert outcome.created
    assert outcome.command.id == stored[0]["id"]


async def test_a_creation_whose_commit_never_arrived_is_still_refused(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    pool = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
    creator = CommandCreator(pool, "node-a", 3600)
    sent = asyncio.Event()

    def commit_lost(chunk: bytes) -> bool:
        if COMMIT in chunk:
            proxy.black_hole()
            sent.set()
            return False  # never reaches PostgreSQL
        return True

    proxy.from_client = commit_lost
    try:
        creating = asyncio.create_task(creator.create(COMMAND))
        async with asyncio.timeout(30):
            await sent.wait()
        proxy.from_client = None
        await proxy.cut()
        proxy.swallowing = False
        await proxy.resume()
        async with asyncio.timeout(30):
            done = await asyncio.gather(creating, return_exceptions=True)
    finally:
        await pool.close()
        await proxy.stop()
    assert isinstance(done[0], (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError))
    assert await db.fetchval("SELECT count(*) FROM command") == 0


async def test_a_campaign_committed_before_its_answer_was_lost_answers_the_campaign(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The same for ``POST /campaigns``: a second campaign would command every target again."""
    proxy = proxy_for(db_dsn)
    await proxy.start()
    pool = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
    service = CampaignService(pool, "node-a", 3600.0)
    request = CampaignRequest(
        name="open-valve", params={}, delivery=Delivery.REALTIME,
        targets=Targets(devices=("dev-1", "dev-2")), per_minute=None, abort=None,
        idempotency_key=None,
    )  # fmt: skip
    _lose_the_commit_answer(proxy)
    try:
        creating = asyncio.create_task(service.create(request, actor="operator"))

        async def committed() -> bool:
            return bool(await db.fetchval("SELECT count(*) FROM campaign"))

        await wait_until(committed, timeout=30, message="the campaign committed")
        proxy.from_client = None
        await proxy.cut()
        proxy.swallowing = False
        await proxy.resume()
        async with asyncio.timeout(30):
            done = await asyncio.gather(creating, return_exceptions=True)
    finally:
        await pool.close()
        await proxy.stop()
    stored = await db.fetch("SELECT id FROM campaign")
    assert len(stored) == 1
    assert await db.fetchval("SELECT count(*) FROM command") == 2
    outcome = done[0]
    assert not isinstance(outcome, BaseException), repr(outcome)
    assert outcome.created
    assert outcome.campaign.id == stored[0]["id"]
