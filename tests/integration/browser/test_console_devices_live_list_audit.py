"""The devices list left open: past its first page ("More devices"), a live update (any
device's event) read the first page alone again, and the rows loaded after it vanished under
the operator; and the ages ("just now") were written once, so a device that fell silent read
"just now" for as long as nothing else happened. A real daemon, broker, PostgreSQL and
chromium."""

from __future__ import annotations

import re
import time

import aiohttp
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


async def devices_known(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM device"))
    finally:
        await conn.close()


async def send(mosquitto: Mosquitto, devices: list[str]) -> None:
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        for device in devices:
            body = msgspec.json.encode({"ts": int(time.time() * 1000), "metrics": {"t": 1}})
            await client.publish(TOPICS.telemetry(device), body, qos=1)


async def test_a_live_update_keeps_the_devices_loaded_past_the_first_page(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    devices = [f"meter-{n:03d}" for n in range(110)]
    await send(mosquitto, devices)

    async def all_known() -> bool:
        return await devices_known(db_dsn) >= len(devices)

    await wait_until(all_known, timeout=30, message="110 devices known")
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/devices")
    rows = page.locator("#device-table tbody tr")
    await expect(rows).to_have_count(100, timeout=WAIT_MS)
    await page.get_by_role("button", name="More devices").click()
    await expect(rows).to_have_count(110, timeout=WAIT_MS)
    # Someone puts a device out of service: a device event, a live update of the list.
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    async with (
        aiohttp.ClientSession(base, headers=auth) as http,
        http.put("/device/out-of-service?id=meter-005", json={"reason": "swap"}) as reply,
    ):
        assert reply.status < 300, await reply.text()
    # The update comes (the list read again, its presence shown): all 110 rows are still there.
    swapped = page.locator("#device-table tbody tr[data-device-id='meter-005']")
    entries = "performance.getEntriesByType('resource')"
    reads = f"{entries}.filter(e => e.name.includes('/devices?')).length"
    await wait_until(
        lambda: page.evaluate(f"{reads} >= 3"), timeout=WAIT_MS / 1000, message="list read again"
    )
    await expect(swapped).to_be_visible(timeout=WAIT_MS)
    await expect(rows).to_have_count(110)
    assert errors.errors == []


async def test_a_device_gone_silent_does_not_read_just_now_on_a_page_left_open(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    await send(mosquitto, ["meter-1"])

    async def known() -> bool:
        return await devices_known(db_dsn) >= 1

    await wait_until(known, timeout=30, message="device known")
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/devices")
    seen = page.locator("#device-table tbody tr[data-device-id='meter-1'] time")
    await expect(seen).to_have_text("just now", timeout=WAIT_MS)
    # A keyboard user on its link: the list read again keeps the focus there.
    link = page.get_by_role("link", name="meter-1", exact=True)
    await link.focus()
    # Nothing more from it, nothing done on the page: its age must grow by itself.
    await expect(seen).to_have_text(re.compile(r"^\d+ s ago$"), timeout=WAIT_MS)
    await expect(link).to_be_focused()
    assert errors.errors == []
