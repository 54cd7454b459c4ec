"""GET /alarm-stats over real HTTP against real PostgreSQL: the figures of a history made of
alarms and of people's actions taken through the API itself; a bad window is a 400 with its
code, never a 500."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg
import pytest

from gateway.config import TokenConfig
from storage.alarms import db_now
from tests.support.alarm_history import raise_alarm
from tests.support.api_client import OPERATOR, VIEWER, ApiClient
from tests.support.api_server import serve_api

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="night shift"),
]


@pytest.fixture
async def client(db_dsn: str) -> AsyncIterator[ApiClient]:
    async with serve_api(db_dsn, TOKENS) as api, aiohttp.ClientSession() as http:
        yield ApiClient(base=api.base, http=http)


def _interval_start(moment: datetime) -> datetime:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    return moment - (moment - epoch) % timedelta(minutes=10)


async def test_the_figures_of_a_history(client: ApiClient, db: asyncpg.Connection) -> None:
    now = await db_now(db)
    # 11 alarms in one past 10-minute interval (a flood), 3 of one pair within 20 s of them.
    base = _interval_start(now) - timedelta(minutes=30)
    ids = [
        await raise_alarm(db, "door", f"door-{i}", base + timedelta(seconds=10 * i))
        for i in range(8)
    ]
    for i in range(3):
        await raise_alarm(db, "temp-high", "t-1", base + timedelta(seconds=100 + 10 * i))
    # Open for two days: stale.
    stale = await raise_alarm(db, "silent", "s-1", now - timedelta(days=2))
    # The operator acknowledges one door alarm through the API.
    reply = await client.call("POST", f"/alarms/{ids[0]}/confirm", token=OPERATOR, json={})
    assert reply.status == 200, reply.body

    reply = await client.get("/alarm-stats?window=1h")
    assert reply.status == 200, reply.body
    stats = reply.body
    assert stats["window"] == "1h"
    assert stats["window_s"] == 3600
    assert stats["alarms"] == 11
    assert stats["thresholds"] == {
        "flood_alarms": 10, "chatter_raises": 3, "chatter_window_s": 60.0,
        "stale_after_s": 86400.0, "target_per_10min": 1.0,
    }  # fmt: skip
    assert stats["per_10min"]["peak"] == 11
    assert stats["per_10min"]["average"] == round(11 / 6, 3)
    [period] = stats["floods"]["periods"]
    assert datetime.fromisoformat(period["starts_at"]) == base
    assert (period["intervals"], period["alarms"], period["peak"]) == (1, 11, 11)
    assert stats["chattering"]["count"] == 1
    [pair] = stats["chattering"]["items"]
    assert (pair["rule_key"], pair["device_id"], pair["alarms"], pair["peak"]) == (
        "temp-high", "t-1", 3, 3,
    )  # fmt: skip
    assert stats["stale"]["count"] == 1
    assert stats["stale"]["oldest"][0]["id"] == stale
    assert stats["top_rules"] == [
        {"key": "door", "alarms": 8, "share": round(8 / 11, 4)},
        {"key": "temp-high", "alarms": 3, "share": round(3 / 11, 4)},
    ]
    assert stats["top_devices"][0] == {"key": "t-1", "alarms": 3, "share": round(3 / 11, 4)}
    [operator] = stats["operators"]
    assert operator["actor"] == "night shift"  # the token's name, from the audit trail
    assert (operator["actions"], operator["acknowledged"], operator["peak_10min"]) == (1, 1, 1)
    ack = stats["acknowledgement"]
    assert ack["acknowledged"] == 1
    # Raised 30 to 40 minutes before `now`, confirmed after it.
    assert 30 * 60 <= ack["median_s"] < 41 * 60
    assert ack["median_s"] == ack["p90_s"] == ack["max_s"] == operator["ack_median_s"]

    # The default window is a day.
    reply = await client.get("/alarm-stats")
    assert reply.status == 200
    assert reply.body["window"] == "24h"
    assert len(reply.body["per_10min"]["series"]) in (144, 145)


@pytest.mark.parametrize(
    "query",
    [
        "window=5m",  # below one interval
        "window=32d",  # beyond 31 days
        "window=1w",
        "window=24",
        "window=1.5h",
        "window=-1h",
        "window=",
        "window=null",
        "window=1h&window=2h",
        "span=1h",
    ],
)
async def test_a_bad_window_is_a_400_with_its_code(client: ApiClient, query: str) -> None:
    reply = await client.get(f"/alarm-stats?{query}")
    assert reply.status == 400, reply.body
    assert reply.body["error"] == "BAD_REQUEST"
    assert reply.body["param"] in {"window", "span"}


async def test_it_needs_a_token(client: ApiClient) -> None:
    reply = await client.get("/alarm-stats", token=None)
    assert reply.status == 401
    assert reply.body["error"] == "UNAUTHORIZED"
