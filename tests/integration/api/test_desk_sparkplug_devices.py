"""The alarm desk over a Sparkplug device's alarms: its id (`{group}/{node}/{device}`, stored
as it reads in `alarm`, docs/sparkplug.md) travels in the query and the body, as the other
routes that must name any device take it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import quote

import aiohttp
import asyncpg
import pytest

from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_server import serve_api

OVEN = "Plant1/Line4/Oven"
EDGE = "Plant1/Line4"


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


async def test_a_sparkplug_devices_group_lists_filters_shelves_and_bulk_acts(api: Api) -> None:
    oven = await api.raise_alarm(OVEN)
    edge = await api.raise_alarm(EDGE)
    native = await api.raise_alarm("boiler-1")
    groups = await api.get("/alarms/groups?by=device")
    assert groups.status == 200, groups.body
    assert {g["key"] for g in groups.body["items"]} == {OVEN, EDGE, "boiler-1"}
    # api.md: "A group's alarms: GET /alarms with the same filters and device= its key".
    for key, alarm in ((OVEN, oven), (EDGE, edge)):
        listed = await api.get(f"/alarms?device={quote(key, safe='')}")
        assert listed.status == 200, f"GET /alarms?device={key}: {listed.status} {listed.body}"
        assert [a["id"] for a in listed.body["items"]] == [alarm]
    by_rule = await api.get(f"/alarms/groups?by=rule&device={quote(OVEN, safe='')}")
    assert by_rule.status == 200, by_rule.body
    assert [(g["key"], g["count"]) for g in by_rule.body["items"]] == [("hot", 1)]
    # A bulk action over the rule's group of that device alone.
    body = {"action": "confirm", "group": {"by": "rule", "key": "hot", "filters": {"device": OVEN}}}
    bulk = await api.post("/alarms/bulk", body)
    assert bulk.status == 200, bulk.body
    assert [i["alarm_id"] for i in bulk.body["items"]] == [oven]
    # POST /shelves: "a rule on a device, whether it has alarms yet or not".
    shelf = await api.post(
        "/shelves", {"device_id": OVEN, "rule_key": "hot", "duration_s": 600, "reason": "oven"}
    )
    assert shelf.status == 201, shelf.body
    assert shelf.body["device_id"] == OVEN
    assert (await api.get(f"/alarms/{oven}")).body["shelved_until"] is not None
    assert (await api.get(f"/alarms/{native}")).body["shelved_until"] is None
    # What is no device id at all is still refused, nothing done.
    for bad in ("Plant1/Line4/Oven/x", "Plant1//Oven", "/Oven", "Oven/", "Plant 1/Line4"):
        refused = await api.get(f"/alarms?device={quote(bad, safe='')}")
        assert (refused.status, refused.body["error"]) == (400, "BAD_REQUEST"), bad
        refused = await api.post(
            "/shelves", {"device_id": bad, "rule_key": "hot", "duration_s": 60, "reason": "x"}
        )
        assert (refused.status, refused.body["error"]) == (422, "INVALID_BODY"), bad
    assert await api.db.fetchval("SELECT count(*) FROM alarm_shelf") == 1
