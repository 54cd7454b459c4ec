"""A bulk action stopped by a deadlock while one alarm's audit row is written: the database
rolled that alarm's change back in a deadlock, it did not refuse the audit row. The item must
say so (``UNAVAILABLE``, "deadlock"), as a deadlock anywhere else in the item does, and the
alarms after it are not attempted, as after any other deadlock.

It answered ``AUDIT_FAILED`` ("its audit row could not be written; see the gateway's log"),
sending the operator to look for a refused row (a constraint, a full disk) that never was, and
counted an audit failure (``gateway_audit_failures_total``) for it. A real deadlock: the test
holds the audit table, then asks for the alarm row the bulk's transaction holds."""

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


async def test_a_deadlock_on_an_alarms_audit_row_is_named_a_deadlock(api: Api) -> None:
    first, second, third = [await api.raise_alarm(f"d{n}") for n in range(3)]
    other = await asyncpg.connect(api.dsn)
    try:
        held = other.transaction()
        await held.start()
        # The first alarm's confirm, once it holds the alarm's row, waits to write its audit
        # row; then this transaction asks for that alarm's row: each waits for the other.
        await other.execute("LOCK TABLE alarm_audit IN EXCLUSIVE MODE")
        reply_task = asyncio.create_task(
            api.post("/alarms/bulk", {"action": "confirm", "ids": [first, second, third]})
        )
        await wait_until(api.a_request_waits_for_a_lock, message="the confirm never waited")
        waiting = await api.db.fetchval(
            "SELECT query FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        assert "alarm_audit" in waiting, waiting  # it waits at its audit row
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
    stopped = items[first]
    assert (stopped["ok"], stopped["error"]) == (False, "UNAVAILABLE"), stopped
    assert "deadlock" in stopped["message"], stopped
    statuses = [
        await api.db.fetchval("SELECT status FROM alarm WHERE id = $1", a)
        for a in (first, second, third)
    ]
    assert statuses == ["NEW", "NEW", "NEW"]
    for later in (second, third):
        item = items[later]
        assert item["error"] == "NOT_ATTEMPTED", item
        assert "deadlock" in item["message"], item
        assert f"alarm {first}," in item["message"], item
