"""The date a silence's creation is confirmed with, in a real browser whose language writes
dates its own way, against a real daemon, broker and PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from playwright.async_api import Browser, expect

from tests.integration.browser.conftest import Console
from tests.support.api_client import OPERATOR
from tests.support.browser import DESKTOP, WAIT_MS, PageErrors, sign_in

ZONE = "America/New_York"


async def test_a_silence_is_confirmed_with_its_end_written_as_every_date_on_the_page(
    console: Console, browser: Browser
) -> None:
    """docs/console.md, "Dates and times": every page writes a date the same way, ISO 8601 order
    on a 24-hour clock in the browser's zone, whatever the browser's language, so that a date
    never reads differently on two screens. An operator whose browser speaks American English
    creates a silence: its confirmation must say the end as the silence list does
    (`2026-12-02 18:00:00`), not `12/2/2026, 6:00:00 PM`."""
    context = await browser.new_context(
        viewport=DESKTOP,  # type: ignore[arg-type]  # a ViewportSize TypedDict
        locale="en-US",
        timezone_id=ZONE,
    )
    page = await context.new_page()
    errors = PageErrors(page)
    await page.goto(f"{console.base}/")
    await sign_in(page, OPERATOR)
    await page.get_by_role("link", name="Notifications").click()
    form = page.locator("#silence-create")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    # An afternoon hour, so a 12-hour clock would show it differently.
    ends = (datetime.now(ZoneInfo(ZONE)) + timedelta(days=1)).replace(
        hour=18, minute=0, second=0, microsecond=0
    )
    await form.get_by_label("Ends at").fill(ends.strftime("%Y-%m-%dT%H:%M"))
    await form.get_by_label("Comment").fill("night shift")
    await form.get_by_role("button", name="Create silence").click()
    shown = ends.strftime("%Y-%m-%d %H:%M:%S")
    row = page.locator("#silence-table tbody tr").first
    await expect(row).to_contain_text(shown, timeout=WAIT_MS)
    await expect(page.locator("#notice")).to_contain_text("created, until", timeout=WAIT_MS)
    await expect(page.locator("#notice")).to_contain_text(f"until {shown}.")
    assert errors.errors == []
    await context.close()
