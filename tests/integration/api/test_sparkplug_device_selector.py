"""`GET /devices?selector=` takes the rules' selector (docs/api.md), and the rules pick Sparkplug
devices by their id or by a glob across its levels (`devices = "Plant1/*"`, docs/sparkplug.md).
The API's pattern held no `/`: `selector=Plant1/*` or `selector=Plant1/Line4/Oven` was a 400,
so the console's device filter could not narrow the list to a Sparkplug group or device."""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import quote

import aiohttp
import asyncpg
import pytest

from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_server import serve_api

DEVICES = ("Plant1/Line4", "Plant1/Line4/Oven", "Plant1/Line5/Pump", "Plant2/Line1/Oven", "door-1")


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


@pytest.mark.parametrize(
    ("selector", "picked"),
    [
        ("Plant1/*", ["Plant1/Line4", "Plant1/Line4/Oven", "Plant1/Line5/Pump"]),
        ("*/Oven", ["Plant1/Line4/Oven", "Plant2/Line1/Oven"]),
        ("Plant1/Line4/Oven", ["Plant1/Line4/Oven"]),
        ("Plant1/Line4,door-*", ["Plant1/Line4", "door-1"]),
    ],
)
async def test_the_device_list_takes_a_selector_of_sparkplug_ids_and_globs(
    api: Api, selector: str, picked: list[str]
) -> None:
    for device in DEVICES:
        await api.db.execute(
            "INSERT INTO device (device_id, first_seen, last_seen) VALUES ($1, now(), now())",
            device,
        )
    reply = await api.get(f"/devices?selector={quote(selector, safe='')}")
    assert reply.status == 200, reply.body
    assert [d["device_id"] for d in reply.body["items"]] == picked


@pytest.mark.parametrize("bad", ["Plant1//Oven", "/Oven", "Plant1/", "a/b/c/d", "Plant 1/*"])
async def test_what_the_rules_refuse_is_still_a_400(api: Api, bad: str) -> None:
    reply = await api.get(f"/devices?selector={quote(bad, safe='')}")
    assert (reply.status, reply.body["error"]) == (400, "BAD_REQUEST"), bad
