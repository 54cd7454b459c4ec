"""The console at a phone's width with the longest device id the protocol allows, in a real
browser against a real daemon, broker and PostgreSQL."""

from __future__ import annotations

from playwright.async_api import Browser, Page, expect

from tests.integration.browser.conftest import Console
from tests.integration.browser.test_console_alarms import alarm_row, publish
from tests.support.api_client import OPERATOR
from tests.support.browser import PHONE, WAIT_MS, open_console, sign_in

# 64 characters, the protocol's longest (protocol/ids.py), with no place a line may break.
LONG_ID = "building_north_floor_03_room_0417_humidity_probe_A1_0123456789ab"


async def _wider_than_the_screen(page: Page) -> list[str]:
    """What sticks out past the right edge of a phone's screen, if anything."""
    return list(
        await page.evaluate(
            """width => {
                const clipped = (e) => {
                    for (let a = e.parentElement; a; a = a.parentElement) {
                        if (getComputedStyle(a).overflowX !== 'visible') return true;
                    }
                    return false;
                };
                const wide = [...document.querySelectorAll('main *')]
                    .filter(e => e.offsetParent !== null && !clipped(e)
                        && e.getBoundingClientRect().right > width + 1);
                // The innermost: what pushes, not what is pushed.
                return wide.filter(e => !wide.some(o => o !== e && e.contains(o)))
                    .map(e => e.outerHTML.slice(0, 160));
            }""",
            PHONE["width"],
        )
    )


async def _fits(page: Page) -> None:
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], (width, await _wider_than_the_screen(page))


async def test_the_longest_device_id_fits_a_phones_width(
    console: Console, browser: Browser
) -> None:
    """docs/console.md: the console is built for a technician's phone (390 px wide); nothing
    is wider than the screen, no sideways scrolling to reach a button. A device id may be 64
    characters long: its row in the alarm list and in the device list must still fit."""
    assert len(LONG_ID) == 64
    await publish(console.mosquitto, LONG_ID, {"metrics": {"temp": 95}})
    page, errors = await open_console(browser, console.base, viewport=PHONE)
    await sign_in(page, OPERATOR)
    await expect(alarm_row(page, LONG_ID)).to_be_visible(timeout=WAIT_MS)
    await _fits(page)

    await alarm_row(page, LONG_ID).get_by_role("link", name="#").first.click()
    await expect(page.locator("#alarm-detail .actions button").first).to_be_visible(timeout=WAIT_MS)
    await _fits(page)

    await page.get_by_role("link", name="Devices").click()
    await expect(page.locator("#device-table").get_by_text(LONG_ID)).to_be_visible(timeout=WAIT_MS)
    await _fits(page)
    await page.locator("#device-table").get_by_role("link", name=LONG_ID).click()
    await expect(page.get_by_role("button", name="Send command")).to_be_visible(timeout=WAIT_MS)
    await _fits(page)

    await page.get_by_role("link", name="show commands").click()
    await expect(page.locator("#view-commands")).to_be_visible(timeout=WAIT_MS)
    await _fits(page)
    assert errors.errors == []
