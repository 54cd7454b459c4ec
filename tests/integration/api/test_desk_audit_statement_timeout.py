"""A statement cancelled at a statement that writes audit rows (``QueryCanceledError``, 57014:
a DBA's ``statement_timeout`` on the database or the role, or a cancel request): PostgreSQL
stopped the statement, it did not refuse the audit row. The answer must say so (503
``UNAVAILABLE``, nothing changed, retry), and the node must not count an audit failure
(``gateway_audit_failures_total``).

A real wait, cut by a real ``statement_timeout``: the database carries one (1 s) shorter than a
person's change's lock wait (5 s), and the test holds ``alarm_audit`` in SHARE mode, as a
``CREATE INDEX`` on it does, so that an alarm's step waits at its audit row until PostgreSQL
cancels it. It was answered 500 ``AUDIT_FAILED`` ("its audit row could not be written; see the
gateway's log") and counted as a refused audit row.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from gateway.alarms.service import AlarmService
from gateway.config import TokenConfig
from gateway.domain.alarm import Action
from storage.audit import audit_failure
from storage.pool import create_pool
from tests.integration.api.test_alarm_action_on_a_held_row import _within
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_client import OPERATOR
from tests.support.api_server import serve_api

TOKENS = [TokenConfig(token=OPERATOR, role="operator", name="night shift")]


@pytest.fixture
async def timed_out_dsn(db_dsn: str) -> str:
    """The test's database with a DBA's ``statement_timeout`` for every session opened after."""
    conn = await asyncpg.connect(db_dsn)
    try:
        name = await conn.fetchval("SELECT current_database()")
        await conn.execute(f'ALTER DATABASE "{name}" SET statement_timeout = 1000')
    finally:
        await conn.close()
    return db_dsn


@pytest.fixture
async def api(timed_out_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(timed_out_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=timed_out_dsn)


@pytest.fixture
async def counted_pool(timed_out_dsn: str) -> AsyncIterator[tuple[asyncpg.Pool, list[str]]]:
    """A pool wired as the daemon's: each audit row it reports refused is appended."""
    refused: list[str] = []
    pool = await create_pool(
        timed_out_dsn,
        min_size=1,
        max_size=4,
        on_audit_failure=lambda table, _exc: refused.append(table),
    )
    try:
        yield pool, refused
    finally:
        await pool.close()


async def test_an_audit_row_cancelled_by_a_statement_timeout_is_not_a_refused_row(
    api: Api, counted_pool: tuple[asyncpg.Pool, list[str]]
) -> None:
    pool, refused = counted_pool
    alarm_id, later = await api.raise_alarm("d1"), await api.raise_alarm("d2")
    service = AlarmService(pool, node_id="t")
    holder = await asyncpg.connect(api.dsn)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE alarm_audit IN SHARE MODE")  # as CREATE INDEX
            with pytest.raises(asyncpg.exceptions.QueryCanceledError) as caught:
                await _within(
                    "a confirm at a held audit table",
                    service.act(alarm_id, Action.CONFIRM, actor="night shift"),
                )
            reply = await _within(
                "the same over HTTP", api.post(f"/alarms/{alarm_id}/confirm", {"note": "x"})
            )
            shelved = await _within(
                "a shelf at a held audit table",
                api.post(f"/alarms/{alarm_id}/shelve", {"duration_s": 600, "reason": "work"}),
            )
            bulk = await _within(
                "a bulk confirm at a held audit table",
                api.post("/alarms/bulk", {"action": "confirm", "ids": [alarm_id, later]}),
            )
    finally:
        await holder.close()
    assert "statement timeout" in str(caught.value), caught.value  # PostgreSQL's, not the bound
    assert refused == []  # a cancelled statement: gateway_audit_failures_total stays
    assert audit_failure(caught.value) is None
    for answer in (reply, shelved):
        assert (answer.status, answer.body["error"]) == (503, "UNAVAILABLE"), answer.body
        assert "cancelled" in answer.body["message"], answer.body
        assert answer.body["message"].endswith("nothing changed, retry"), answer.body
    assert bulk.status == 200, bulk.body
    stopped, rest = bulk.body["items"]
    assert (stopped["error"], rest["error"]) == ("UNAVAILABLE", "NOT_ATTEMPTED"), bulk.body
    assert "cancelled" in stopped["message"], stopped
    assert f"alarm {alarm_id}," in rest["message"], rest
    statuses = await api.db.fetch("SELECT DISTINCT status FROM alarm")
    assert [r["status"] for r in statuses] == ["NEW"]
    assert await api.db.fetchval("SELECT count(*) FROM alarm_shelf") == 0
