"""A device whose clock runs ahead (8 hours: a wrong time zone, an RTC set by hand): its
latest value on the device page is dated 8 hours from now, and the page said "just now" of it,
as of a fresh reading. A time in the future must read as one. A real daemon, broker,
PostgreSQL and chromium."""

from __future__ import annotations

import re
import time

import aiomqtt
import asyncpg
import msgspec
from playwright.async_api import Browser, expect

from protocol import Topics
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
CONFIG = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"
"""


async def stored(dsn: str, device: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        sql = "SELECT count(*) FROM telemetry WHERE device_id = $1"
        return bool(await conn.fetchval(sql, device))
    finally:
        await conn.close()


async def test_a_reading_dated_hours_ahead_is_not_said_to_be_just_now(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    ahead_ms = int(time.time() * 1000) + 8 * 3600 * 1000
    body = msgspec.json.encode({"ts": ahead_ms, "metrics": {"temp": 21.5}})
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        await client.publish(TOPICS.telemetry("clock-ahead-1"), body, qos=1)
    await wait_until(lambda: stored(db_dsn, "clock-ahead-1"), timeout=30, message="stored")
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/devices/clock-ahead-1")
    metric = page.locator("#device-detail .metric[data-metric='temp']")
    await expect(metric.locator(".value")).to_have_text("21.5", timeout=WAIT_MS)
    age = metric.locator("time")
    await expect(age).not_to_have_text("just now")
    await expect(age).to_have_text(re.compile(r"^8 h ahead$"))
    assert errors.errors == []
