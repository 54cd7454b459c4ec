"""A lock wait past a person's change's bound (``lock_timeout``, 55P03) at a statement that
writes audit rows: PostgreSQL gave up waiting for a lock another transaction holds, it did not
refuse the audit row. The answer must say what was held (503 ``UNAVAILABLE``, retry), and the
node must not count an audit failure (``gateway_audit_failures_total``).

Two real waits, each on a lock the test holds in real PostgreSQL:

* the ``alarm_audit`` table, held in SHARE mode as a ``CREATE INDEX`` on it holds it (a newer
  node's migration, a DBA's index): an alarm's action takes the alarm row, then waits at its
  audit row. It was answered "alarm N is held by another transaction", which it was not, and
  counted as a refused audit row. A shelf, whose audit rows wait there too, was answered 500
  ``AUDIT_FAILED``.
* a command row of a campaign, held as a node stopped in the middle of a dispatch holds it:
  the campaign's cancel locks and cancels its commands and writes their audit rows in one
  statement. It was answered 500 ``AUDIT_FAILED`` ("its audit row could not be written; see the
  gateway's log") and counted, for a row held.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from gateway.alarms.service import AlarmHeldError, AlarmService
from gateway.commands.campaigns import CampaignService
from gateway.config import TokenConfig
from gateway.domain.alarm import Action
from storage.pool import create_pool
from tests.integration.api.test_alarm_action_on_a_held_row import _within
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_client import OPERATOR
from tests.support.api_server import serve_api

TOKENS = [TokenConfig(token=OPERATOR, role="operator", name="night shift")]


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


@pytest.fixture
async def counted_pool(db_dsn: str) -> AsyncIterator[tuple[asyncpg.Pool, list[str]]]:
    """A pool wired as the daemon's: each audit row it reports refused is appended."""
    refused: list[str] = []
    pool = await create_pool(
        db_dsn, min_size=1, max_size=4, on_audit_failure=lambda table, _exc: refused.append(table)
    )
    try:
        yield pool, refused
    finally:
        await pool.close()


async def test_an_alarms_audit_row_waiting_for_its_held_table_is_named_so_and_not_counted(
    api: Api, counted_pool: tuple[asyncpg.Pool, list[str]]
) -> None:
    pool, refused = counted_pool
    alarm_id = await api.raise_alarm("d1")
    service = AlarmService(pool, node_id="t")
    holder = await asyncpg.connect(api.dsn)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE alarm_audit IN SHARE MODE")  # as CREATE INDEX
            with pytest.raises(AlarmHeldError) as caught:
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
    finally:
        await holder.close()
    assert refused == []  # a held table, no refused row: gateway_audit_failures_total stays
    message = str(caught.value)
    assert "alarm_audit table, held by another transaction" in message, message
    assert "nothing changed; retry" in message, message
    assert (reply.status, reply.body["error"]) == (503, "UNAVAILABLE"), reply.body
    assert reply.body["alarm_id"] == alarm_id, reply.body
    assert "alarm_audit table" in reply.body["message"], reply.body
    assert (shelved.status, shelved.body["error"]) == (503, "UNAVAILABLE"), shelved.body
    assert "held by another transaction" in shelved.body["message"], shelved.body
    assert await api.db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "NEW"
    assert await api.db.fetchval("SELECT count(*) FROM alarm_shelf") == 0


async def test_a_campaign_cancel_waiting_for_a_held_command_is_a_held_row_not_a_refused_audit(
    api: Api, counted_pool: tuple[asyncpg.Pool, list[str]]
) -> None:
    pool, refused = counted_pool
    await api.db.executemany(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ($1, now(), now())",
        [("pump-1",), ("pump-2",)],
    )
    started = await api.post(
        "/campaigns", {"name": "reboot", "targets": {"devices": ["pump-1", "pump-2"]}}
    )
    assert started.status == 201, started.body
    campaign_id = started.body["campaign"]["id"]
    held = await api.db.fetchval("SELECT min(id) FROM command WHERE campaign_id = $1", campaign_id)
    holder = await asyncpg.connect(api.dsn)
    try:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM command WHERE id = $1 FOR UPDATE", held)
            reply = await _within(
                "a campaign cancel over a held command",
                api.post(f"/campaigns/{campaign_id}/cancel", {}),
            )
            with pytest.raises(asyncpg.exceptions.LockNotAvailableError):
                await _within(
                    "the same through a counting pool",
                    CampaignService(pool, "t", 3600.0).cancel(campaign_id, actor="night shift"),
                )
    finally:
        await holder.close()
    assert (reply.status, reply.body["error"]) == (503, "UNAVAILABLE"), reply.body
    assert "held by another transaction" in reply.body["message"], reply.body
    assert refused == []
    statuses = await api.db.fetch(
        "SELECT DISTINCT status FROM command WHERE campaign_id = $1", campaign_id
    )
    assert [r["status"] for r in statuses] == ["PENDING"]
