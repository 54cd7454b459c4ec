"""The console's Unshelve on an alarm two shelves cover, in a real browser against a real
daemon, broker and PostgreSQL."""

from __future__ import annotations

from playwright.async_api import Browser, expect

from tests.integration.browser.test_console_alarms import (
    SECOND_OPERATOR,
    Console,
    alarm_row,
    api,
    publish,
)
from tests.support.api_client import OPERATOR, VIEWER
from tests.support.browser import WAIT_MS, open_console, sign_in


async def test_unshelve_returns_an_alarm_two_operators_shelved_two_ways(
    console: Console, browser: Browser
) -> None:
    """Olga shelved the alarm; ivan shelved its rule on its device (both allowed: one shelf
    per alarm, one per pair). Unshelve on the alarm must return it to annunciation, not lift
    one of the two shelves, say "unshelved", and leave the alarm shelved by the other."""
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    await expect(page.locator("#alarm-empty")).to_be_visible(timeout=WAIT_MS)
    await publish(console.mosquitto, "door-7", {"events": [{"type": "DOOR_OPEN"}]})
    row = alarm_row(page, "door-7")
    await expect(row).to_be_visible(timeout=WAIT_MS)
    alarm_id = await row.get_attribute("data-alarm-id")
    await api(console.base, "POST", f"/alarms/{alarm_id}/shelve", OPERATOR,
              {"scope": "alarm", "duration_s": 3600, "reason": "mine"})  # fmt: skip
    await api(console.base, "POST", f"/alarms/{alarm_id}/shelve", SECOND_OPERATOR,
              {"scope": "pair", "duration_s": 3600, "reason": "the door's sensor"})  # fmt: skip
    await page.goto(f"{console.base}/#/alarms/{alarm_id}")
    detail = page.locator("#alarm-detail")
    unshelve = detail.get_by_role("button", name="Unshelve")
    await expect(unshelve).to_be_visible(timeout=WAIT_MS)
    await unshelve.click()
    await expect(page.locator("#notice")).to_contain_text("unshelved", timeout=WAIT_MS)
    await expect(detail.get_by_role("button", name="Shelve", exact=True)).to_be_visible(
        timeout=WAIT_MS
    )
    await expect(unshelve).to_have_count(0)
    alarm = await api(console.base, "GET", f"/alarms/{alarm_id}", VIEWER)
    assert isinstance(alarm, dict)
    assert alarm["shelved_until"] is None
    assert errors.errors == []
