"""A command sent from the console whose answer is lost on the way back (a proxy cut, a
node restarting after its COMMIT): the page must not say it failed, and Send again must not
send the device the command a second time. A real daemon, PostgreSQL and chromium; the
answer dropped by Playwright after the gateway has handled the request."""

from __future__ import annotations

import asyncio

import asyncpg
from playwright.async_api import Browser, Locator, Page, Route, expect

from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, PageErrors, open_console, sign_in
from tests.support.waiting import wait_until

CONFIG = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"
"""


async def commands_of(dsn: str, device: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT id, name FROM command WHERE device_id = $1 ORDER BY id", device
        )
    finally:
        await conn.close()
    return [(r["id"], r["name"]) for r in rows]


async def command_form(
    browser: Browser, base: str, device: str, name: str
) -> tuple[Page, PageErrors, Locator]:
    """An operator's console on ``device``'s commands, its form filled with ``name``
    (deferrable), not sent yet."""
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/commands/{device}")
    form = page.locator("#command-create")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    await form.get_by_label("Name").fill(name)
    await form.get_by_label("Delivery").select_option("deferrable")
    return page, errors, form


async def test_a_command_whose_answer_was_lost_is_not_sent_twice_by_send_again(
    base: str, db_dsn: str, browser: Browser
) -> None:
    page, errors, form = await command_form(browser, base, "quiet-1", "open-valve")

    handled: list[int] = []

    async def lose_the_answer(route: Route) -> None:
        if route.request.method != "POST":
            await route.continue_()
            return
        response = await route.fetch()  # the gateway handles it (and commits) ...
        handled.append(response.status)
        await route.abort("connectionreset")  # ... and its answer never reaches the page

    await page.route("**/commands", lose_the_answer)
    await form.get_by_role("button", name="Send").click()
    notice = page.locator("#notice")
    await expect(notice).to_contain_text("no answer", timeout=WAIT_MS)
    assert handled == [201], handled
    # Created, whatever the page could learn: it must not claim a failure.
    await expect(notice).not_to_contain_text("Could not send")
    await page.unroute("**/commands", lose_the_answer)

    # The operator tries again, the form as it was.
    await form.get_by_role("button", name="Send").click()
    await expect(notice).to_contain_text("already existed", timeout=WAIT_MS)
    sent = await commands_of(db_dsn, "quiet-1")
    assert len(sent) == 1, f"the device was sent the command twice: {sent}"
    rows = page.locator("#command-table tbody tr")
    await expect(rows).to_have_count(1, timeout=WAIT_MS)

    # Sent again on purpose once answered: a new command, as the operator asked.
    await form.get_by_role("button", name="Send").click()
    await expect(rows).to_have_count(2, timeout=WAIT_MS)
    await expect(notice).to_contain_text("created", timeout=WAIT_MS)
    assert len(await commands_of(db_dsn, "quiet-1")) == 2
    assert errors.errors == []


async def test_send_clicked_again_while_the_answer_is_slow_sends_one_command(
    base: str, db_dsn: str, browser: Browser
) -> None:
    page, errors, form = await command_form(browser, base, "quiet-2", "reboot")

    held: list[Route] = []

    async def hold_until_two(route: Route) -> None:
        if route.request.method != "POST":
            await route.continue_()
            return
        held.append(route)
        if len(held) == 2:  # the first answer is slow: the operator clicked Send again
            for each in held:
                await each.continue_()

    await page.route("**/commands", hold_until_two)
    send = form.get_by_role("button", name="Send")
    await send.click()
    await wait_until(lambda: len(held) == 1, timeout=WAIT_MS / 1000, message="first POST held")
    await send.click()
    await expect(page.locator("#command-table tbody tr")).to_have_count(1, timeout=WAIT_MS)
    await expect(page.locator("#notice")).to_contain_text("already existed", timeout=WAIT_MS)
    sent = await commands_of(db_dsn, "quiet-2")
    assert len(sent) == 1, f"the device was sent the command twice: {sent}"
    assert errors.errors == []


async def test_a_send_whose_answer_never_comes_is_given_up_and_sent_again_once(
    base: str, db_dsn: str, browser: Browser
) -> None:
    """The link goes silent after the gateway took the command (no answer, no reset): the
    page must say so in time, not wait as long as the browser would, and Send again must get
    the first command back."""
    page, errors, form = await command_form(browser, base, "quiet-3", "open-valve")

    handled: list[int] = []
    silent = asyncio.Event()  # never set: the answer never comes

    async def go_silent(route: Route) -> None:
        if route.request.method != "POST":
            await route.continue_()
            return
        response = await route.fetch()  # the gateway creates it ...
        handled.append(response.status)
        await silent.wait()  # ... and nothing comes back

    await page.route("**/commands", go_silent)
    await form.get_by_role("button", name="Send").click()
    notice = page.locator("#notice")
    await expect(notice).to_contain_text("no answer", timeout=WAIT_MS * 2)
    assert handled == [201], handled
    await page.unroute("**/commands", go_silent)
    await form.get_by_role("button", name="Send").click()
    await expect(notice).to_contain_text("already existed", timeout=WAIT_MS)
    assert len(await commands_of(db_dsn, "quiet-3")) == 1
    assert errors.errors == []
