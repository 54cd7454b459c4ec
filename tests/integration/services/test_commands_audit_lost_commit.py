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
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

from gateway.commands.campaigns import CampaignRequest, CampaignService, Targets
from gateway.commands.creator import CommandCreator, NewCommand
from gateway.domain.command import Delivery
from storage.pool import create_pool
from tests.integration.services.test_ingest_lost_commit import COMMIT, _lose_the_commit_answer
from tests.support.dsn import proxy_for, through
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

COMMAND = NewCommand(
    device_id="dev-1",
    name="open-valve",
    params={"valve": 3},
    delivery=Delivery.REALTIME,
    idempotency_key=None,
    actor="operator",
)


@contextlib.asynccontextmanager
async def _through_proxy(db_dsn: str) -> AsyncIterator[tuple[TcpProxy, asyncpg.Pool]]:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    pool = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
    try:
        yield proxy, pool
    finally:
        await pool.close()
        await proxy.stop()


async def _once_committed(db: asyncpg.Connection, table: str) -> None:
    async def committed() -> bool:
        return bool(await db.fetchval(f"SELECT count(*) FROM {table}"))  # noqa: S608 - a table name of ours

    await wait_until(committed, timeout=30, message=f"the {table} committed")


async def _cut_and_answered(proxy: TcpProxy, creating: asyncio.Task[Any]) -> Any:
    """The connection cut (the answer lost with it), the proxy passing again: what the
    creation answers, or raised."""
    proxy.from_client = None
    await proxy.cut()
    proxy.swallowing = False
    await proxy.resume()
    async with asyncio.timeout(30):
        (outcome,) = await asyncio.gather(creating, return_exceptions=True)
    return outcome


async def test_a_creation_committed_before_its_answer_was_lost_answers_the_command(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    async with _through_proxy(db_dsn) as (proxy, pool):
        creator = CommandCreator(pool, "node-a", 3600)
        _lose_the_commit_answer(proxy)
        creating = asyncio.create_task(creator.create(COMMAND))
        await _once_committed(db, "command")
        outcome = await _cut_and_answered(proxy, creating)
    stored = await db.fetch("SELECT id FROM command")
    assert len(stored) == 1
    # Not "the database is not reachable; retry": the command exists and goes to the device.
    assert not isinstance(outcome, BaseException), repr(outcome)
    assert outcome.created
    assert outcome.command.id == stored[0]["id"]


async def test_a_creation_whose_commit_never_arrived_is_still_refused(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    async with _through_proxy(db_dsn) as (proxy, pool):
        creator = CommandCreator(pool, "node-a", 3600)
        sent = asyncio.Event()

        def commit_lost(chunk: bytes) -> bool:
            if COMMIT in chunk:
                proxy.black_hole()
                sent.set()
                return False  # never reaches PostgreSQL
            return True

        proxy.from_client = commit_lost
        creating = asyncio.create_task(creator.create(COMMAND))
        async with asyncio.timeout(30):
            await sent.wait()
        outcome = await _cut_and_answered(proxy, creating)
    assert isinstance(outcome, (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError))
    assert await db.fetchval("SELECT count(*) FROM command") == 0


async def test_a_campaign_committed_before_its_answer_was_lost_answers_the_campaign(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The same for ``POST /campaigns``: a second campaign would command every target again."""
    request = CampaignRequest(
        name="open-valve", params={}, delivery=Delivery.REALTIME,
        targets=Targets(devices=("dev-1", "dev-2")), per_minute=None, abort=None,
        idempotency_key=None,
    )  # fmt: skip
    async with _through_proxy(db_dsn) as (proxy, pool):
        service = CampaignService(pool, "node-a", 3600.0)
        _lose_the_commit_answer(proxy)
        creating = asyncio.create_task(service.create(request, actor="operator"))
        await _once_committed(db, "campaign")
        outcome = await _cut_and_answered(proxy, creating)
    stored = await db.fetch("SELECT id FROM campaign")
    assert len(stored) == 1
    assert await db.fetchval("SELECT count(*) FROM command") == 2
    assert not isinstance(outcome, BaseException), repr(outcome)
    assert outcome.created
    assert outcome.campaign.id == stored[0]["id"]
