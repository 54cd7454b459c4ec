"""The commands list past its first page: the fleet's 50 newest commands were all the page
ever showed, with nothing to say there were more, so an older command (the one an operator
looks for) could not be reached. Older pages, and the list read again (a new command, the
2 s read of open ones) keeping every row shown, once each. A real daemon, PostgreSQL and
chromium."""

from __future__ import annotations

import re
import time

import aiohttp
from playwright.async_api import Browser, Route, expect

from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in
from tests.support.waiting import wait_until

CONFIG = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"
"""


async def test_older_commands_are_reachable_and_a_new_one_skips_or_repeats_none(
    base: str, browser: Browser
) -> None:
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    async with aiohttp.ClientSession(base, headers=auth) as http:

        async def send(device: str) -> int:
            body = {"name": "open-valve", "delivery": "deferrable"}
            async with http.post(f"/devices/{device}/commands", json=body) as reply:
                assert reply.status == 201, await reply.text()
                command_id: int = (await reply.json())["command"]["id"]
                return command_id

        # Nobody answers: every command stays open (the page reads the list every 2 s).
        ids = [await send(f"quiet-{n}") for n in range(60)]
        page, errors = await open_console(browser, base)
        await sign_in(page, OPERATOR)
        await page.goto(f"{base}/#/commands")
        rows = page.locator("#command-table tbody tr")
        await expect(rows).to_have_count(50, timeout=WAIT_MS)
        older = page.get_by_role("button", name="Older commands")
        await expect(older).to_be_visible(timeout=WAIT_MS)
        await older.click()
        await expect(rows).to_have_count(60, timeout=WAIT_MS)
        await expect(older).to_be_hidden()
        # A new command meanwhile: it comes on top, and nothing shown is dropped or doubled.
        newest = await send("quiet-new")
        await expect(rows).to_have_count(61, timeout=WAIT_MS)
        shown = [int(x) for x in await rows.evaluate_all("rs => rs.map(r => r.dataset.commandId)")]
        assert shown == sorted([*ids, newest], reverse=True), shown
        assert errors.errors == []


async def test_older_commands_slow_to_come_are_not_dropped_by_the_2_s_read(
    base: str, browser: Browser
) -> None:
    """The older page is slow; meanwhile the 2 s read of the open commands comes and goes:
    the older page, once it comes, is shown, not dropped as overtaken."""
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    async with aiohttp.ClientSession(base, headers=auth) as http:
        for n in range(55):
            body = {"name": "open-valve", "delivery": "deferrable"}
            async with http.post(f"/devices/quiet-{n}/commands", json=body) as reply:
                assert reply.status == 201, await reply.text()
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/commands")
    rows = page.locator("#command-table tbody tr")
    await expect(rows).to_have_count(50, timeout=WAIT_MS)
    held: list[Route] = []
    polls: list[str] = []

    async def hold_older(route: Route) -> None:
        if "before=" in route.request.url and not held:
            held.append(route)
            return
        polls.append(route.request.url)
        await route.continue_()

    await page.route(re.compile(r".*/commands\?.*"), hold_older)
    await page.get_by_role("button", name="Older commands").click()
    await wait_until(lambda: bool(held), timeout=WAIT_MS / 1000, message="older page asked")
    # Past the page's 2 s read of the open commands (its own timer: nothing to wait on but
    # the time it takes), the older page still held.
    held_at = time.monotonic()
    await wait_until(
        lambda: time.monotonic() - held_at > 2.5, timeout=10, message="a 2 s read's time"
    )
    await held[0].continue_()
    await expect(rows).to_have_count(55, timeout=WAIT_MS)
    assert errors.errors == []
