"""A bulk action stopped by a deadlock on one alarm: the database answered (it rolled that
alarm's change back), it never went out of reach. The items must say what happened."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_server import serve_api
from tests.support.waiting import wait_until


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


async def test_a_bulk_action_stopped_by_a_deadlock_says_so(api: Api) -> None:
    first, second, third = [await api.raise_alarm(f"d{n}") for n in range(3)]
    other = await asyncpg.connect(api.dsn)
    try:
        held = other.transaction()
        await held.start()
        # The first alarm's confirm, once it holds the alarm's row, waits for its event (the
        # outbox); then this transaction asks for that alarm's row: each waits for the other.
        await other.execute("LOCK TABLE outbox_event IN EXCLUSIVE MODE")
        reply_task = asyncio.create_task(
            api.post("/alarms/bulk", {"action": "confirm", "ids": [first, second, third]})
        )
        await wait_until(api.a_request_waits_for_a_lock, message="the confirm never waited")
        try:
            # The bulk's backend waited first: its deadlock check runs first and rolls it back.
            await other.execute("SELECT 1 FROM alarm WHERE id = $1 FOR UPDATE", first)
        finally:
            await held.rollback()
        reply = await reply_task
    finally:
        await other.close()
    assert reply.status == 200, reply.body
    items = {i["alarm_id"]: i for i in reply.body["items"]}
    statuses = [
        await api.db.fetchval("SELECT status FROM alarm WHERE id = $1", a)
        for a in (first, second, third)
    ]
    assert statuses == ["NEW", "NEW", "NEW"]
    stopped = items[first]
    assert (stopped["ok"], stopped["error"]) == (False, "UNAVAILABLE"), stopped
    assert "deadlock" in stopped["message"], stopped
    for later in (second, third):
        item = items[later]
        assert item["error"] == "NOT_ATTEMPTED", item
        assert "out of reach" not in item["message"], item
        assert "deadlock" in item["message"], item
        assert f"alarm {first}," in item["message"], item
