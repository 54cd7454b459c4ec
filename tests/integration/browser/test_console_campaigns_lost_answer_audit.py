"""A campaign started from the console whose answer is lost on the way back (a proxy cut, a
node restarting after its COMMIT): the page must not say it could not start, and Start
campaign again must not start a second campaign. A real daemon, broker, PostgreSQL and
chromium; the answer dropped by Playwright after the gateway has handled the request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiomqtt
import asyncpg
import msgspec
from playwright.async_api import Browser, Locator, Page, Route, expect

from protocol import Topics
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, PageErrors, open_console, sign_in
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
CONFIG = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"
"""


async def fetchval(dsn: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def pumps(db_dsn: str, mosquitto: Mosquitto) -> None:
    devices = ["pump-1", "pump-2"]
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        for device in devices:
            body = msgspec.json.encode({"ts": int(time.time() * 1000), "metrics": {"rpm": 1}})
            await client.publish(TOPICS.telemetry(device), body, qos=1)

    async def known() -> bool:
        sql = "SELECT count(*) FROM device WHERE device_id = ANY($1::text[])"
        return bool(await fetchval(db_dsn, sql, devices) == len(devices))

    await wait_until(known, timeout=30, message="devices known")


async def reviewed_campaign(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> tuple[Page, PageErrors, Locator]:
    """The pumps known; an operator's console with "reboot" to ``pump-*`` reviewed, its
    confirmation shown, not started yet."""
    await pumps(db_dsn, mosquitto)
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.get_by_role("link", name="Campaigns").click()
    form = page.locator("#campaign-create")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    await form.get_by_label("Command", exact=True).fill("reboot")
    await form.get_by_label("Targets (selector)").fill("pump-*")
    await form.get_by_role("button", name="Review campaign").click()
    await expect(page.locator("#campaign-confirm")).to_be_visible(timeout=WAIT_MS)
    return page, errors, form


async def test_a_campaign_whose_answer_was_lost_is_not_started_twice(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    page, errors, form = await reviewed_campaign(base, db_dsn, mosquitto, browser)

    handled: list[int] = []

    async def lose_the_answer(route: Route) -> None:
        if route.request.method != "POST":
            await route.continue_()
            return
        response = await route.fetch()  # the gateway starts it ...
        handled.append(response.status)
        await route.abort("connectionreset")  # ... and its answer never reaches the page

    await page.route("**/campaigns", lose_the_answer)
    start = page.get_by_role("button", name="Start campaign")
    await start.click()
    notice = page.locator("#notice")
    await expect(notice).to_contain_text("no answer", timeout=WAIT_MS)
    assert handled == [201], handled
    # Started, whatever the page could learn: it must not claim it could not.
    await expect(notice).not_to_contain_text("Could not start")
    # Start again, its answer lost too; then Back and the same campaign reviewed again.
    await page.evaluate("document.getElementById('notice').textContent = ''")
    await start.click()
    await expect(notice).to_contain_text("no answer", timeout=WAIT_MS)
    assert handled == [201, 200], handled
    await page.unroute("**/campaigns", lose_the_answer)
    await page.get_by_role("button", name="Back").click()
    await form.get_by_role("button", name="Review campaign").click()
    await expect(page.locator("#campaign-confirm")).to_be_visible(timeout=WAIT_MS)
    await start.click()
    await expect(notice).to_contain_text("already started", timeout=WAIT_MS)
    assert await fetchval(db_dsn, "SELECT count(*) FROM campaign") == 1
    await expect(page.locator("#campaign-table tbody tr")).to_have_count(1, timeout=WAIT_MS)
    assert errors.errors == []


async def test_a_start_whose_answer_never_comes_can_be_started_again_without_a_reload(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    """The link goes silent after the gateway took the start (no answer, no reset): the page
    must give up on it in time and let Start campaign be clicked again, not keep the button
    disabled for as long as the browser would wait."""
    page, errors, _form = await reviewed_campaign(base, db_dsn, mosquitto, browser)

    handled: list[int] = []
    silent = asyncio.Event()  # never set: the answer never comes

    async def go_silent(route: Route) -> None:
        if route.request.method != "POST":
            await route.continue_()
            return
        response = await route.fetch()  # the gateway starts it ...
        handled.append(response.status)
        await silent.wait()  # ... and nothing comes back

    await page.route("**/campaigns", go_silent)
    start = page.get_by_role("button", name="Start campaign")
    await start.click()
    notice = page.locator("#notice")
    await expect(notice).to_contain_text("no answer", timeout=WAIT_MS * 2)
    assert handled == [201], handled
    await page.unroute("**/campaigns", go_silent)
    await expect(start).to_be_enabled()
    await start.click()
    await expect(notice).to_contain_text("already started", timeout=WAIT_MS)
    assert await fetchval(db_dsn, "SELECT count(*) FROM campaign") == 1
    assert errors.errors == []
