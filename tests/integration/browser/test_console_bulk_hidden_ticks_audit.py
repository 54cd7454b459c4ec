"""The alarm list's bulk bar after the operator filters again, in a real browser against a real
daemon, broker and PostgreSQL: what a ticked alarm that the new filter hides becomes."""

from __future__ import annotations

from playwright.async_api import Browser, expect

from tests.integration.browser.conftest import Console
from tests.integration.browser.test_console_alarms import alarm_row, api, publish
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in


async def test_a_ticked_alarm_a_new_filter_hides_is_not_acted_on(
    console: Console, browser: Browser
) -> None:
    """An operator ticks the pump's alarm, then filters the list to the door's, ticks that one
    and presses **False alarm**, looking at one ticked row. Only the door's alarm may be marked
    false: the pump's, out of sight since the filter, must not be acted on unseen (before, the
    bar said "2 alarms selected" and both were marked false)."""
    await publish(console.mosquitto, "pump-1", {"events": [{"type": "DOOR_OPEN"}]})
    await publish(console.mosquitto, "door-1", {"events": [{"type": "DOOR_OPEN"}]})
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    await expect(alarm_row(page, "pump-1")).to_be_visible(timeout=WAIT_MS)
    await expect(alarm_row(page, "door-1")).to_be_visible(timeout=WAIT_MS)
    await alarm_row(page, "pump-1").get_by_role("checkbox").check()
    form = page.locator("#alarm-filters")
    await form.get_by_label("Device").fill("door-1")
    await form.get_by_role("button", name="Filter").click()
    await expect(alarm_row(page, "pump-1")).to_have_count(0, timeout=WAIT_MS)
    await alarm_row(page, "door-1").get_by_role("checkbox").check()
    await expect(page.locator("#bulk-count")).to_have_text("1 alarm selected:")
    await page.locator("#bulk-bar").get_by_role("button", name="False alarm").click()
    await expect(page.locator("#bulk-results li")).to_have_count(1, timeout=WAIT_MS)
    door = await api(console.base, "GET", "/alarms?device=door-1", OPERATOR)
    pump = await api(console.base, "GET", "/alarms?device=pump-1", OPERATOR)
    assert isinstance(door, dict)
    assert isinstance(pump, dict)
    assert [a["status"] for a in door["items"]] == ["FALSE"]
    assert [a["status"] for a in pump["items"]] != ["FALSE"], (
        "the pump's alarm, ticked then hidden by the filter, was marked false"
    )
    assert errors.errors == []
