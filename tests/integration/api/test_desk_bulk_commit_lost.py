"""A bulk action when the database goes away as one alarm's change is committed: the server
committed it, its answer never came back. The item must not say that nothing of it changed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
import pytest

from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_server import serve_api
from tests.support.tcp_proxy import TcpProxy

COMMITTED = b"COMMIT\x00"  # the server's CommandComplete for a COMMIT


@pytest.fixture
async def proxy(db_dsn: str) -> AsyncIterator[TcpProxy]:
    target = urlsplit(db_dsn)
    assert target.hostname is not None
    async with TcpProxy(target.hostname, target.port or 5432) as running:
        yield running


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection, proxy: TcpProxy) -> AsyncIterator[Api]:
    target = urlsplit(db_dsn)
    through = urlunsplit(target._replace(netloc=f"{target.username}@127.0.0.1:{proxy.port}"))
    async with serve_api(through, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


async def test_an_alarm_whose_commit_answer_was_lost_is_not_said_unchanged(
    api: Api, proxy: TcpProxy
) -> None:
    first, second, third = [await api.raise_alarm(f"d{n}") for n in range(3)]
    commits = 0
    cutting: list[asyncio.Task[None]] = []

    def server_says(data: bytes) -> bool:
        """The first alarm's COMMIT answer passes; the second's is lost with the network."""
        nonlocal commits
        if COMMITTED not in data or cutting:
            return not cutting
        commits += 1
        if commits < 2:
            return True
        cutting.append(asyncio.get_running_loop().create_task(proxy.cut()))
        return False

    proxy.from_server = server_says
    reply = await api.post("/alarms/bulk", {"action": "confirm", "ids": [first, second, third]})
    assert reply.status == 200, reply.body
    assert cutting, "the second alarm's COMMIT answer was never seen"
    await cutting[0]
    statuses = [
        await api.db.fetchval("SELECT status FROM alarm WHERE id = $1", a)
        for a in (first, second, third)
    ]
    # The server committed the second alarm's confirm; only its answer was lost.
    assert statuses == ["CONFIRMED", "CONFIRMED", "NEW"]
    items = {i["alarm_id"]: i for i in reply.body["items"]}
    assert (items[first]["ok"], items[first]["status"]) == (True, "CONFIRMED")
    assert items[third]["error"] == "NOT_ATTEMPTED"
    lost = items[second]
    assert (lost["ok"], lost["error"]) == (False, "UNAVAILABLE")
    # BulkItem: "nothing of an alarm that is not ok changed" -- unless it says it may have.
    assert lost.get("outcome_unknown") is True, (
        f"alarm {second} was confirmed, and its item says nothing of it changed: {lost}"
    )
    await proxy.resume()
