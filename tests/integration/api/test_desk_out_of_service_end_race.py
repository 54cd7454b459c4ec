"""Ending out of service while another operator replaces the period: the DELETE's transaction
began before the other operator's PUT (its node busy between BEGIN and its statements, a
request queued for the pool...), and the period it meets was put in force after it began."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from gateway.alarms import shelving
from storage.alarms import db_now
from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_server import serve_api


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


async def test_a_delete_begun_before_another_operators_put_ends_the_period_it_put(
    api: Api,
) -> None:
    """Docs (api.md, DELETE /devices/{id}/out-of-service): "end it now (the period in force
    when it writes: one another request put in force meanwhile is the one ended)". Operator
    A's DELETE began its transaction; operator B's PUT replaced the period and committed; A's
    DELETE then writes: it must end B's period, not fail (a 500) on the period's check that
    it ends no earlier than it began."""
    await api.db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('m1', now(), now())"
    )
    first = await api.put("/devices/m1/out-of-service", {"reason": "earlier"})
    assert first.status == 200, first.body
    other = await asyncpg.connect(api.dsn)
    try:
        # Operator A's DELETE: its transaction begun (the database's now() fixed) ...
        a_request = other.transaction()
        await a_request.start()
        began = await db_now(other)
        # ... operator B's PUT, at the same moment, replaces the period and commits ...
        replaced = await api.put("/devices/m1/out-of-service", {"reason": "operator B"})
        assert replaced.status == 200, replaced.body
        # ... then A's DELETE writes, the gateway's own code on A's connection.
        try:
            ended = await shelving.end_out_of_service(other, "m1", actor="olga")
        except asyncpg.PostgresError as exc:
            raise AssertionError(
                f"A's DELETE failed (the API answers 500 INTERNAL): {type(exc).__name__}: {exc}"
            ) from exc
        await a_request.commit()
    finally:
        await other.close()
    assert ended["id"] == replaced.body["id"]
    assert ended["ended_by"] == "olga"
    assert ended["ended_at"] >= ended["since"]
    assert ended["since"] > began
    assert (await api.get("/devices/m1")).body["device"]["out_of_service"] is None
    assert (
        await api.db.fetchval("SELECT count(*) FROM device_out_of_service WHERE ended_at IS NULL")
        == 0
    )
