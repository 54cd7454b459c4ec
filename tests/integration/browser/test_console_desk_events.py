"""Another operator's shelf and maintenance period, seen on an open console at once (a real
browser, daemon, broker and PostgreSQL): shelving, lifting and out of service write their
events (docs/topics-and-payloads.md, ``shelf.*`` and ``device.*``), so a desk that did nothing
shows a shelved alarm leave its list, an unshelved one return, and a device page its period."""

from __future__ import annotations

from typing import Any

import asyncpg
from playwright.async_api import Browser, Locator, Page, expect

from tests.integration.browser.test_console_alarms import Console, alarm_row, api, publish
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, PageErrors, open_console, sign_in
from tests.support.waiting import wait_until


async def desk_with_a_shelved_alarm(
    console: Console, browser: Browser, device: str
) -> tuple[Page, PageErrors, Locator, dict[str, Any]]:
    """An operator's desk open on the default list, with a door alarm of ``device`` on it;
    then another client shelves it for ten minutes (``POST /alarms/{id}/shelve``): the page,
    its errors, the alarm's row and the shelf."""
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    await expect(page.locator("#alarm-empty")).to_be_visible(timeout=WAIT_MS)
    await publish(console.mosquitto, device, {"events": [{"type": "DOOR_OPEN"}]})
    row = alarm_row(page, device)
    await expect(row).to_be_visible(timeout=WAIT_MS)
    alarm_id = await row.get_attribute("data-alarm-id")
    shelf = await api(
        console.base, "POST", f"/alarms/{alarm_id}/shelve", OPERATOR,
        {"duration_s": 600, "reason": "sensor swap"},
    )  # fmt: skip
    assert isinstance(shelf, dict)
    return page, errors, row, shelf


async def test_another_operators_shelf_and_its_lift_reach_an_open_desk(
    console: Console, browser: Browser
) -> None:
    # Another operator shelves it for ten minutes: it leaves this desk's default list.
    page, errors, row, shelf = await desk_with_a_shelved_alarm(console, browser, "door-7")
    await expect(row).to_be_hidden(timeout=WAIT_MS)
    await expect(page.locator(".count-total-shelved")).to_have_text("shelved 1")

    # ... and lifts it: the alarm returns to annunciation here, long before the shelf's end.
    await api(console.base, "DELETE", f"/shelves/{shelf['id']}", OPERATOR)
    await expect(row).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator(".count-total-shelved")).to_have_text("shelved 0")
    assert errors.errors == []


async def test_another_operators_maintenance_period_reaches_an_open_device_page(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    await publish(console.mosquitto, "pump-3", {"metrics": {"temp": 20}})

    async def known() -> bool:
        return bool(await db.fetchval("SELECT count(*) FROM device WHERE device_id = 'pump-3'"))

    await wait_until(known, timeout=WAIT_MS / 1000)
    await page.goto(f"{console.base}/#/devices/pump-3")
    service = page.locator("#device-detail dd.out-of-service")
    await expect(service).to_have_text("in service", timeout=WAIT_MS)

    await api(
        console.base, "PUT", "/devices/pump-3/out-of-service", OPERATOR, {"reason": "seal swap"}
    )
    await expect(service).to_contain_text("out of service since", timeout=WAIT_MS)
    await expect(service).to_contain_text("seal swap")
    await api(console.base, "DELETE", "/devices/pump-3/out-of-service", OPERATOR)
    await expect(service).to_have_text("in service", timeout=WAIT_MS)
    assert errors.errors == []
