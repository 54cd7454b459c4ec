"""The console when a shelf runs out, in a real browser against a real daemon, broker and
PostgreSQL: the alarm returns to annunciation (docs/behaviour.md §5, Shelving) on time, by the
page's own reading at the shelf's end or by the timers' ``shelf.ended``, whichever comes first."""

from __future__ import annotations

import asyncpg
from playwright.async_api import Browser, expect

from tests.integration.browser.test_console_alarms import Console
from tests.integration.browser.test_console_desk_events import desk_with_a_shelved_alarm
from tests.support.browser import WAIT_MS

SECONDS_LEFT = 8  # the shelf's time left when the page reads the list


async def test_an_alarm_whose_shelf_runs_out_comes_back_on_the_open_list(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """The list shows the default view (shelved alarms left out). A shelf of one of its alarms
    runs out while the page is open and nothing else happens: the alarm must come back on
    the list, and the header's shelved count go back to 0, without the operator asking."""
    page, errors, row, shelf = await desk_with_a_shelved_alarm(console, browser, "door-5")
    # It runs out soon: a few seconds after the page reads the list again.
    await db.execute(
        "UPDATE alarm_shelf SET until = now() + make_interval(secs => $2) WHERE id = $1",
        shelf["id"],
        SECONDS_LEFT,
    )
    await page.locator("#alarm-filters").get_by_role("button", name="Filter").click()
    await expect(row).to_be_hidden(timeout=WAIT_MS)
    await expect(page.locator(".count-total-shelved")).to_have_text("shelved 1")
    # Nothing else happens on the page: it comes back by itself.
    await expect(row).to_be_visible(timeout=(SECONDS_LEFT + 15) * 1000)
    await expect(page.locator(".count-total-shelved")).to_have_text("shelved 0")
    assert errors.errors == []
