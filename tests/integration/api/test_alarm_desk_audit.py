"""Two operators on the alarm desk at once, over real HTTP against real PostgreSQL: the
moments their requests meet are forced with a transaction held open on a second connection
(running the gateway's own code, as the other operator's request or the other node's timer
would), and released once the request under test waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import asyncpg
import pytest

from gateway.alarms import shelving
from gateway.config import TokenConfig
from tests.support.api_client import ADMIN, OPERATOR, VIEWER, ApiClient, Reply
from tests.support.api_server import serve_api
from tests.support.waiting import wait_until

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]


@dataclass
class Api(ApiClient):
    db: asyncpg.Connection
    dsn: str

    async def put(self, path: str, body: Any, *, token: str = OPERATOR) -> Reply:
        return await self.call("PUT", path, json=body, token=token)

    async def a_request_waits_for_a_lock(self) -> bool:
        return bool(
            await self.db.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        )


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


@pytest.mark.parametrize("in_force_before", [False, True])
async def test_two_operators_putting_a_device_out_of_service_at_once_both_get_200(
    api: Api, in_force_before: bool
) -> None:
    """`PUT /devices/{id}/out-of-service` replaces a period in force. Operator A's request
    (its transaction held open here, run by the gateway's own code) has ended the period in
    force, if any, and written its own; operator B's request meets it. B must replace A's
    period (200), as it would a moment later, not fail with a 500 on the unique index of
    the open period."""
    await api.db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('m1', now(), now())"
    )
    if in_force_before:
        first = await api.put("/devices/m1/out-of-service", {"reason": "earlier"})
        assert first.status == 200, first.body
    other = await asyncpg.connect(api.dsn)
    try:
        held = other.transaction()
        await held.start()
        mine = await shelving.set_out_of_service(
            other, "m1", reason="operator A", until=None, actor="olga", request_id=None
        )
        request = asyncio.create_task(
            api.put("/devices/m1/out-of-service", {"reason": "operator B"})
        )
        await wait_until(
            api.a_request_waits_for_a_lock, message="B's request waits for A's transaction"
        )
        await held.commit()
        reply = await request
    finally:
        await other.close()
    assert reply.status == 200, reply.body
    assert (reply.body["reason"], reply.body["set_by"]) == ("operator B", "console")
    device = (await api.get("/devices/m1")).body["device"]
    assert device["out_of_service"]["id"] == reply.body["id"]
    # A's period was replaced by B's: ended, by B.
    a_row = await api.db.fetchrow(
        "SELECT ended_at, ended_by FROM device_out_of_service WHERE id = $1", mine["id"]
    )
    assert a_row["ended_by"] == "console"
    assert (
        await api.db.fetchval("SELECT count(*) FROM device_out_of_service WHERE ended_at IS NULL")
        == 1
    )


async def test_ending_out_of_service_while_another_operator_replaces_the_period_ends_the_new_one(
    api: Api,
) -> None:
    """Operator A replaces the period in force (its transaction held open here); operator B's
    `DELETE /devices/{id}/out-of-service` waits for it, so it comes after A's: it must end the
    period A put in force (200), not answer 409 `NOT_OUT_OF_SERVICE` and leave the device out
    of service."""
    await api.db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('m1', now(), now())"
    )
    first = await api.put("/devices/m1/out-of-service", {"reason": "earlier"})
    assert first.status == 200, first.body
    other = await asyncpg.connect(api.dsn)
    try:
        held = other.transaction()
        await held.start()
        mine = await shelving.set_out_of_service(
            other, "m1", reason="operator A", until=None, actor="olga", request_id=None
        )
        request = asyncio.create_task(
            api.call("DELETE", "/devices/m1/out-of-service", token=OPERATOR)
        )
        await wait_until(
            api.a_request_waits_for_a_lock, message="B's request waits for A's transaction"
        )
        await held.commit()
        reply = await request
    finally:
        await other.close()
    assert reply.status == 200, reply.body
    assert (reply.body["id"], reply.body["ended_by"]) == (mine["id"], "console")
    assert (await api.get("/devices/m1")).body["device"]["out_of_service"] is None
    assert (
        await api.db.fetchval("SELECT count(*) FROM device_out_of_service WHERE ended_at IS NULL")
        == 0
    )
