"""A bulk action while the ``alarm_audit`` table is held (in SHARE mode, as a ``CREATE INDEX``
on it holds it: a newer node's migration, a DBA's index): the first alarm's audit row waits
the change's lock bound (5 s) and gives up. Every later alarm's audit row would wait for the
same table: the action stops there, as after a deadlock or the database gone, and the alarms
after it are ``NOT_ATTEMPTED``, their message naming the held table.

Each later alarm was tried, and waited its 5 s in turn: a bulk of ``[alarms] bulk_max`` (500)
alarms during an index build held its connection and its operator for 40 minutes, long after
any HTTP client had given up, to answer the same held table 500 times. Real PostgreSQL, the
table held by the test."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import pytest

from tests.integration.api.test_alarm_action_on_a_held_row import _within
from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_server import serve_api

LOCK_WAIT_S = 5.0  # gateway.alarms.service.LOCK_WAIT_S


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


async def bulk_at_held_table(
    api: Api, table: str
) -> tuple[list[int], dict[int, dict[str, Any]], float]:
    """Three alarms raised, then confirmed in one bulk action while another transaction holds
    ``table`` in SHARE mode (as CREATE INDEX does): their ids, the answer's items by alarm id,
    and how long the answer took."""
    ids = [await api.raise_alarm(f"d{n}") for n in range(3)]
    holder = await asyncpg.connect(api.dsn)
    try:
        async with holder.transaction():
            await holder.execute(f"LOCK TABLE {table} IN SHARE MODE")
            started = time.monotonic()
            reply = await _within(
                f"a bulk action at a held {table} table",
                api.post("/alarms/bulk", {"action": "confirm", "ids": ids}),
            )
            took = time.monotonic() - started
    finally:
        await holder.close()
    assert reply.status == 200, reply.body
    return ids, {i["alarm_id"]: i for i in reply.body["items"]}, took


async def test_a_bulk_action_stops_at_a_held_audit_table(api: Api) -> None:
    ids, items, took = await bulk_at_held_table(api, "alarm_audit")
    first, *later = ids
    stopped = items[first]
    assert (stopped["ok"], stopped["error"]) == (False, "UNAVAILABLE"), stopped
    assert "alarm_audit table" in stopped["message"], stopped
    for alarm_id in later:
        item = items[alarm_id]
        assert item["error"] == "NOT_ATTEMPTED", item
        assert f"alarm {first}," in item["message"], item
        assert "alarm_audit table" in item["message"], item
    assert took < 2 * LOCK_WAIT_S, took  # one wait, not one per alarm
    statuses = [await api.db.fetchval("SELECT status FROM alarm WHERE id = $1", a) for a in ids]
    assert statuses == ["NEW", "NEW", "NEW"]
