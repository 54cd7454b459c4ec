"""The console's alarm list when the operator loaded older alarms and a live update comes, in a
real browser against a real daemon, broker and PostgreSQL."""

from __future__ import annotations

import uuid

import asyncpg
from playwright.async_api import Browser, expect

from gateway.alarms.lifecycle import AlarmRequest, create_alarms
from storage.alarms import db_now
from tests.integration.browser.test_console_alarms import Console, api
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in

ALARMS = 205  # the page reads 200 at a time


async def test_older_alarms_loaded_stay_listed_through_a_live_update(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """An alarm flood: more open alarms than a page. The operator presses "Older alarms" and
    reads them; another operator confirms an alarm meanwhile (a live update). The older
    alarms are still in the view: they must stay listed, not drop off the page (nor be
    marked "no longer in this view")."""
    async with db.transaction():
        created = await create_alarms(
            db,
            [
                AlarmRequest(device_id=f"flood-{n:03d}", rule_key="door-open", severity="MAJOR",
                             telemetry_event_id=uuid.uuid4().hex, reason="flood")
                for n in range(ALARMS)
            ],
            node_id="ingest",
            now=await db_now(db),
        )  # fmt: skip
    ids = sorted(c.alarm.id for c in created if c.alarm is not None)
    oldest, newest = ids[0], ids[-1]
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    rows = page.locator("#alarm-table tbody tr")
    await expect(rows).to_have_count(200, timeout=WAIT_MS)
    await page.get_by_role("button", name="Older alarms").click()
    await expect(rows).to_have_count(ALARMS, timeout=WAIT_MS)
    oldest_row = page.locator(f'#alarm-table tbody tr[data-alarm-id="{oldest}"]')
    await expect(oldest_row).to_be_visible()

    await api(console.base, "POST", f"/alarms/{newest}/confirm", OPERATOR, {})
    newest_row = page.locator(f'#alarm-table tbody tr[data-alarm-id="{newest}"]')
    await expect(newest_row).to_contain_text("CONFIRMED", timeout=WAIT_MS)
    await expect(rows).to_have_count(ALARMS)
    await expect(oldest_row).to_be_visible()
    await expect(oldest_row).not_to_contain_text("no longer in this view")
    assert errors.errors == []
