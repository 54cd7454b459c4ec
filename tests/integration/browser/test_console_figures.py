"""The console's Figures page in a real browser, against a real daemon, broker and PostgreSQL:
a device chattering over MQTT, an operator acting through the API, and a scripted past (a
flood, a stale alarm) all show as numbers; the daemon's figures loop sets the same gauges."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import aiohttp
import aiomqtt
import asyncpg
import msgspec
import pytest
from playwright.async_api import Browser, Locator, expect

from protocol import Topics
from storage.alarms import db_now
from tests.support.alarm_history import raise_alarm
from tests.support.api_client import OPERATOR, VIEWER
from tests.support.browser import WAIT_MS, open_console, require_chromium, sign_in
from tests.support.daemon import make_config, running_daemon, scrape
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
CONFIG = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"

[[api.tokens]]
name = "wall"
token = "{VIEWER}"
role = "viewer"

[alarms.figures]
interval_s = 1

[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
"""


@pytest.fixture
async def port(db_dsn: str, mosquitto: Mosquitto) -> AsyncIterator[int]:
    require_chromium()
    port = free_port()
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=CONFIG)
    async with running_daemon(config):
        yield port


async def door_open(mosquitto: Mosquitto, device: str) -> None:
    body = {"ts": int(time.time() * 1000), "events": [{"type": "DOOR_OPEN"}]}
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        await client.publish(TOPICS.telemetry(device), msgspec.json.encode(body), qos=1)


async def alarms_of(dsn: str, device: str) -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT id FROM alarm WHERE device_id = $1 ORDER BY id", device)
    finally:
        await conn.close()
    return [r["id"] for r in rows]


def interval_start(moment: datetime) -> datetime:
    return moment - (moment - datetime(1970, 1, 1, tzinfo=UTC)) % timedelta(minutes=10)


async def test_the_figures_page_shows_the_numbers(
    port: int, db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, browser: Browser
) -> None:
    base = f"http://127.0.0.1:{port}"
    # A door chattering: three openings within seconds, three alarms (each supersedes the last).
    for _ in range(3):
        # Counted before the opening: read after it, a quick daemon's alarm is already there.
        count = len(await alarms_of(db_dsn, "door-1"))
        await door_open(mosquitto, "door-1")
        await wait_until(
            lambda c=count: _more(db_dsn, "door-1", c), timeout=30, message="an alarm more"
        )
    newest = (await alarms_of(db_dsn, "door-1"))[-1]
    # Olga confirms the newest through the API.
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{base}/alarms/{newest}/confirm",
            json={},
            headers={"Authorization": f"Bearer {OPERATOR}"},
        ) as reply,
    ):
        assert reply.status == 200, await reply.text()
    # The past: 11 alarms in one 10-minute interval an hour ago (a flood), one open for 2 days.
    now = await db_now(db)
    flood_at = interval_start(now) - timedelta(hours=1)
    for i in range(11):
        await raise_alarm(db, "leak", f"leak-{i}", flood_at + timedelta(seconds=30 * i))
    await raise_alarm(db, "silent", "cellar", now - timedelta(days=2))

    # The loop samples the same figures into the gauges, every second here.
    async def gauges_caught_up() -> bool:
        series = await scrape(port)
        return (
            series.get("gateway_alarm_figures_chattering") == 1
            and series.get("gateway_alarm_figures_stale") == 1
            and series.get("gateway_alarm_figures_open") == 13  # 1 door, 11 leaks, the cellar
        )

    await wait_until(gauges_caught_up, timeout=30, message="the figures' gauges")

    page, errors = await open_console(browser, base)
    await sign_in(page, VIEWER)
    await page.get_by_role("link", name="Figures").click()
    figure = page.locator("#figures")

    def tile(name: str) -> Locator:
        return figure.locator(f".metric[data-figure='{name}'] .value")

    await expect(tile("alarms")).to_have_text("14", timeout=WAIT_MS)  # 3 doors, 11 leaks
    await expect(tile("peak")).to_have_text("11")
    await expect(tile("floods")).to_have_text("1")
    await expect(tile("chattering")).to_have_text("1")
    await expect(tile("stale")).to_have_text("1")
    await expect(figure.locator("tr[data-chatter='door-open/door-1']")).to_contain_text("3")
    await expect(figure.locator("tr[data-rule='leak']")).to_contain_text("11")
    await expect(figure.locator("tr[data-device='door-1']")).to_contain_text("3")
    await expect(figure.locator("tr[data-actor='olga']")).to_be_visible()
    await expect(figure.locator("svg.chart.bars rect.flood")).to_have_count(1)
    await expect(figure.locator(".metric[data-figure='ack-median']")).to_contain_text(
        "1 acknowledged"
    )
    # The stale alarm links to its page.
    await figure.locator("tr[data-alarm-id] a").click()
    await expect(page.locator("#alarm-detail")).to_contain_text("cellar", timeout=WAIT_MS)
    # A window of an hour: the flood's interval began an hour ago, partly outside it or not;
    # the door alarms are in it whatever.
    await page.get_by_role("link", name="Figures").click()
    await page.get_by_label("Window").select_option("1h")
    await expect(figure.locator("p.hint").first).to_be_visible(timeout=WAIT_MS)
    await expect(tile("chattering")).to_have_text("1", timeout=WAIT_MS)
    assert errors.errors == []


async def _more(dsn: str, device: str, count: int) -> bool:
    return len(await alarms_of(dsn, device)) > count
