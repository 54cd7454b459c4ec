"""A Cancel (a command's, a campaign's) whose answer is lost on the way back (a proxy cut, a
node restarting after its COMMIT): the row beside it says CANCELLED, and the notice said
"Could not cancel". A real daemon, PostgreSQL and chromium; the answer dropped by Playwright
after the gateway has handled the request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
from playwright.async_api import Browser, Route, expect

from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in

CONFIG = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"
"""


async def post(base: str, path: str, body: object) -> dict[str, object]:
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    async with aiohttp.ClientSession(base, headers=auth) as http, http.post(path, json=body) as r:
        assert r.status == 201, await r.text()
        answer: dict[str, object] = await r.json()
        return answer


def losing(handled: list[int]) -> Callable[[Route], Awaitable[None]]:
    async def lose_the_answer(route: Route) -> None:
        response = await route.fetch()  # the gateway cancels it ...
        handled.append(response.status)
        await route.abort("connectionreset")  # ... and its answer never reaches the page

    return lose_the_answer


async def test_a_command_cancel_whose_answer_was_lost_is_not_said_to_have_failed(
    base: str, browser: Browser
) -> None:
    answer = await post(base, "/devices/quiet-1/commands", {"name": "open-valve"})
    command_id = answer["command"]["id"]  # type: ignore[index]
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/commands/quiet-1")
    row = page.locator(f"#command-table tbody tr[data-command-id='{command_id}']")
    handled: list[int] = []
    await page.route(f"**/commands/{command_id}/cancel", losing(handled))
    await row.get_by_role("button", name="Cancel").click()
    await expect(row.locator(".status")).to_have_text("CANCELLED", timeout=WAIT_MS)
    assert handled == [200], handled
    notice = page.locator("#notice")
    await expect(notice).to_contain_text(f"Command {command_id} cancelled", timeout=WAIT_MS)
    await expect(notice).not_to_contain_text("Could not")
    assert errors.errors == []


async def test_a_campaign_cancel_whose_answer_was_lost_is_not_said_to_have_failed(
    base: str, browser: Browser
) -> None:
    body = {"name": "open-valve", "targets": {"devices": ["quiet-1", "quiet-2"]}}
    answer = await post(base, "/campaigns", body)
    campaign_id = answer["campaign"]["id"]  # type: ignore[index]
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.get_by_role("link", name="Campaigns").click()
    row = page.locator(f"#campaign-table tbody tr[data-campaign-id='{campaign_id}']")
    await expect(row.locator(".status").first).to_have_text("RUNNING", timeout=WAIT_MS)
    handled: list[int] = []
    await page.route(f"**/campaigns/{campaign_id}/cancel", losing(handled))
    await row.get_by_role("button", name=f"Cancel campaign {campaign_id}").click()
    await expect(row.locator(".status").first).to_have_text("CANCELLED", timeout=WAIT_MS)
    assert handled == [200], handled
    notice = page.locator("#notice")
    await expect(notice).to_contain_text(f"Campaign {campaign_id} cancelled", timeout=WAIT_MS)
    await expect(notice).not_to_contain_text("Could not")
    assert errors.errors == []
