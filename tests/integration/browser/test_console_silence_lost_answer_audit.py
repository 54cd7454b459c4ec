"""A silence created (or expired) on the console whose answer is lost on the way back (a
proxy cut, a node restarting after its COMMIT): the page said "Could not create the
silence", the form still filled in; created again, two silences muted alike, and expiring
"the" silence left the other muting. A real daemon, PostgreSQL and chromium; the answer
dropped by Playwright after the gateway has handled the request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

import asyncpg
from playwright.async_api import Browser, Route, expect

from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in

CONFIG = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"
"""


def losing(handled: list[int], method: str) -> Callable[[Route], Awaitable[None]]:
    async def lose_the_answer(route: Route) -> None:
        if route.request.method != method:
            await route.continue_()
            return
        response = await route.fetch()  # the gateway does it ...
        handled.append(response.status)
        await route.abort("connectionreset")  # ... and its answer never reaches the page

    return lose_the_answer


async def silences(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM notify_silence"))
    finally:
        await conn.close()


async def test_a_silence_whose_answer_was_lost_is_said_created_and_expired(
    base: str, db_dsn: str, browser: Browser
) -> None:
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.get_by_role("link", name="Notifications").click()
    form = page.locator("#silence-create")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    ends = (datetime.now() + timedelta(hours=2)).replace(second=0, microsecond=0)
    await form.get_by_label("Rules (comma-separated)").fill("door-open")
    await form.get_by_label("Ends at").fill(ends.strftime("%Y-%m-%dT%H:%M"))
    await form.get_by_label("Comment").fill("lab maintenance")
    handled: list[int] = []
    await page.route("**/silences", losing(handled, "POST"))
    await form.get_by_role("button", name="Create silence").click()
    notice = page.locator("#notice")
    await expect(notice).to_contain_text("created", timeout=WAIT_MS)
    assert handled == [201], handled
    await expect(notice).not_to_contain_text("Could not")
    # Done: the form is emptied as after any creation, not left to be sent again.
    await expect(form.get_by_label("Comment")).to_have_value("")
    assert await silences(db_dsn) == 1

    row = page.locator("#silence-table tbody tr").first
    await page.route("**/silences/*", losing(handled, "DELETE"))
    await row.get_by_role("button", name="Expire").click()
    await expect(row.locator(".active")).to_have_text("expired by olga", timeout=WAIT_MS)
    await expect(notice).to_contain_text("expired", timeout=WAIT_MS)
    await expect(notice).not_to_contain_text("Could not")
    assert errors.errors == []
