"""A silence for a Sparkplug device through the API. A silence's `devices` are the rules'
selector (gateway/domain/notify_match.py: a Sparkplug id, or a glob across its levels, as in
`[[notify.silences]]`), but `POST /silences` refused any `/`: an operator could not silence
the notifications of `Plant1/Line4/Oven` while it was being repaired (422 INVALID_BODY)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg
import pytest

from tests.integration.api.test_notify_api import TOKENS
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.api_server import serve_api


@pytest.fixture
async def api(db_dsn: str) -> AsyncIterator[ApiClient]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield ApiClient(served.base, http)


def _later() -> str:
    return (datetime.now(UTC) + timedelta(hours=1)).isoformat()


@pytest.mark.parametrize(
    "devices", ["Plant1/Line4/Oven", ["Plant1/Line4/Oven", "Plant1/Line4"], ["Plant2/*", "door-1"]]
)
async def test_a_silence_names_sparkplug_devices(api: ApiClient, devices: object) -> None:
    body = {"matchers": {"devices": devices}, "ends_at": _later(), "comment": "oven repair"}
    created = await api.call("POST", "/silences", token=OPERATOR, json=body)
    assert created.status == 201, created.body
    assert created.body["matchers"] == {"devices": devices}


@pytest.mark.parametrize("bad", ["Plant1//Oven", "/Oven", "Plant1/", "a/b/c/d", "Plant 1/*"])
async def test_what_the_rules_refuse_is_still_refused(
    api: ApiClient, db: asyncpg.Connection, bad: str
) -> None:
    body = {"matchers": {"devices": [bad]}, "ends_at": _later()}
    reply = await api.call("POST", "/silences", token=OPERATOR, json=body)
    assert (reply.status, reply.body["error"]) == (422, "INVALID_BODY"), bad
    assert await db.fetchval("SELECT count(*) FROM notify_silence") == 0
