"""How long ago a device was heard from, on a screen whose clock is wrong: the console counts
from the gateway's clock (each answer's `Date`), not the browser's. A control-room tablet whose
clock ran ten minutes behind showed "just now" for a device silent for ten minutes; one ahead
showed a live device as silent. A real browser against a real daemon, broker and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from playwright.async_api import Browser, expect

from tests.integration.browser.conftest import Console
from tests.integration.browser.test_console_alarms import publish
from tests.support.api_client import OPERATOR
from tests.support.browser import DESKTOP, WAIT_MS, PageErrors, sign_in
from tests.support.waiting import wait_until


@pytest.mark.parametrize("off", [timedelta(minutes=-10), timedelta(minutes=10)])
async def test_last_seen_is_counted_on_the_gateways_clock_not_the_browsers(
    console: Console, browser: Browser, db: asyncpg.Connection, off: timedelta
) -> None:
    """fridge-1 was last heard from 10 minutes ago (the database's clock); the browser's clock
    is `off`. The device list and the device's page say "10 min ago"."""
    await publish(console.mosquitto, "fridge-1", {"metrics": {"temp": 4.0}})

    async def stored() -> bool:
        return bool(await db.fetchval("SELECT count(*) FROM device WHERE device_id = 'fridge-1'"))

    await wait_until(stored, timeout=30, message="fridge-1 stored")
    await db.execute(
        "UPDATE device SET last_seen = now() - interval '10 minutes',"
        " first_seen = now() - interval '1 hour' WHERE device_id = 'fridge-1'"
    )
    context = await browser.new_context(viewport=DESKTOP)  # type: ignore[arg-type]  # a ViewportSize TypedDict
    page = await context.new_page()
    await page.clock.set_system_time(datetime.now(UTC) + off)
    errors = PageErrors(page)
    await page.goto(f"{console.base}/")
    await sign_in(page, OPERATOR)
    await page.goto(f"{console.base}/#/devices")
    row = page.locator("#device-table tbody tr", has_text="fridge-1")
    await expect(row.locator("[data-label='Last seen']")).to_have_text(
        "10 min ago", timeout=WAIT_MS
    )
    await row.get_by_role("link", name="fridge-1").click()
    detail = page.locator("#device-detail")
    await expect(detail).to_contain_text("(10 min ago)", timeout=WAIT_MS)
    assert errors.errors == []
    await context.close()
