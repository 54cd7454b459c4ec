"""Campaigns past the first page: once "Older campaigns" had loaded more, a new campaign
(a live update) read as many campaigns again from the newest, and the oldest one shown
dropped out of the list from under the operator. A real daemon, PostgreSQL and chromium."""

from __future__ import annotations

import aiohttp
from playwright.async_api import Browser, expect

from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in

CONFIG = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"
"""


async def test_a_new_campaign_pushes_none_of_the_older_ones_loaded_out(
    base: str, browser: Browser
) -> None:
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    async with aiohttp.ClientSession(base, headers=auth) as http:

        async def start(n: int) -> int:
            body = {"name": f"job-{n}", "targets": {"devices": [f"quiet-{n}"]}}
            async with http.post("/campaigns", json=body) as reply:
                assert reply.status == 201, await reply.text()
                campaign_id: int = (await reply.json())["campaign"]["id"]
                return campaign_id

        ids = [await start(n) for n in range(25)]
        page, errors = await open_console(browser, base)
        await sign_in(page, OPERATOR)
        await page.get_by_role("link", name="Campaigns").click()
        rows = page.locator("#campaign-table tbody tr")
        await expect(rows).to_have_count(20, timeout=WAIT_MS)
        await page.get_by_role("button", name="Older campaigns").click()
        await expect(rows).to_have_count(25, timeout=WAIT_MS)
        newest = await start(99)
        await expect(rows.first).to_have_attribute("data-campaign-id", str(newest), timeout=WAIT_MS)
        await expect(rows).to_have_count(26)
        shown = [int(x) for x in await rows.evaluate_all("rs => rs.map(r => r.dataset.campaignId)")]
        assert shown == sorted([*ids, newest], reverse=True), shown
        assert errors.errors == []
