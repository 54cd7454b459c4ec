"""A bulk action over the group of a device whose id is long: a Sparkplug id
(`{group}/{node}/{device}`, each level up to 64 characters, docs/sparkplug.md) that
`GET /alarms/groups?by=device` lists as its key."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_server import serve_api

LONG = f"{'G' * 64}/{'N' * 64}/{'D' * 64}"  # the longest Sparkplug device id


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


async def test_a_bulk_action_takes_the_group_of_a_long_sparkplug_device_id(api: Api) -> None:
    alarm = await api.raise_alarm(LONG)
    group = (await api.get("/alarms/groups?by=device")).body["items"][0]
    assert (group["key"], group["newest_id"]) == (LONG, alarm)
    body = {"action": "confirm", "group": {"by": "device", "key": LONG, "up_to": alarm}}
    reply = await api.post("/alarms/bulk", body)
    assert reply.status == 200, f"the group GET /alarms/groups listed was refused: {reply.body}"
    assert [(i["alarm_id"], i["status"]) for i in reply.body["items"]] == [(alarm, "CONFIRMED")]
    # One character more is no device id nor rule key: refused, nothing done.
    body["group"]["key"] = LONG + "D"
    refused = await api.post("/alarms/bulk", body)
    assert (refused.status, refused.body["error"]) == (422, "INVALID_BODY")
