"""A bulk action over a group from the console, when an alarm joins the group after the page
drew it, in a real browser against a real daemon, broker and PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg
from playwright.async_api import Browser, Route, expect

from tests.integration.browser.test_console_alarms import (
    Console,
    alarm_row,
    publish,
)
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in
from tests.support.waiting import wait_until


async def test_confirming_a_group_leaves_an_alarm_raised_after_the_page_drew_it(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """Olga sees the group temp-high with two alarms, selects it and presses Confirm; a third
    boiler's alarm joined the group a moment before, and the page has not drawn it yet (its
    reads are held here: the live update in flight). Acknowledging an alarm nobody saw is
    what a bulk action over a group "as GET /alarms/groups showed it" must not do: the two
    shown are confirmed, the third is left for a person to see."""
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    await expect(page.locator("#alarm-empty")).to_be_visible(timeout=WAIT_MS)
    for device, temp in (("boiler-1", 91), ("boiler-2", 92)):
        await publish(console.mosquitto, device, {"metrics": {"temp": temp}})
        await expect(alarm_row(page, device)).to_be_visible(timeout=WAIT_MS)
    filters = page.locator("#alarm-filters")
    await filters.get_by_label("Group by").select_option("rule")
    await filters.get_by_role("button", name="Filter").click()
    group = page.locator("#alarm-groups tr.group-row", has_text="temp-high")
    await expect(group.locator(".group-count")).to_have_text("2", timeout=WAIT_MS)
    await group.get_by_role("checkbox").check()

    released = asyncio.Event()

    async def hold_reads(route: Route) -> None:
        if route.request.method == "GET":
            await released.wait()
        await route.continue_()

    await page.route("**/alarms**", hold_reads)
    await publish(console.mosquitto, "boiler-3", {"metrics": {"temp": 93}})

    async def third_raised() -> bool:
        return bool(
            await db.fetchval("SELECT count(*) = 1 FROM alarm WHERE device_id = 'boiler-3'")
        )

    await wait_until(third_raised, message="boiler-3's alarm raised")
    await expect(group.locator(".group-count")).to_have_text("2")
    async with page.expect_response(lambda r: r.request.method == "POST") as answer:
        await page.get_by_role("button", name="Confirm selected").click()
    assert (await answer.value).status == 200
    released.set()
    statuses = dict(
        await db.fetch("SELECT device_id, status FROM alarm WHERE rule_key = 'temp-high'")
    )
    assert statuses["boiler-1"] == statuses["boiler-2"] == "CONFIRMED"
    assert statuses["boiler-3"] in {"NEW", "PUSHED"}, statuses
    assert errors.errors == []
