"""The console's live stream when the event it resumes from is past every event of the
database it comes back to, in a real browser against a real daemon, broker and PostgreSQL."""

from __future__ import annotations

import asyncpg
from playwright.async_api import Browser, expect

from tests.integration.browser.test_console_alarms import alarm_row, console_daemon, publish
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, require_chromium, sign_in
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port


async def test_a_page_whose_last_event_the_database_no_longer_has_goes_live_again(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, browser: Browser
) -> None:
    """The daemon comes back on a database that lost the newest events (a failover to a
    standby that was behind, a restore): the page's last event id is past every event there,
    so a resume from it is 400 `CURSOR_AHEAD` (docs/api.md, "A cursor ahead"), every time. The
    page must not retry that forever, "reconnecting…" with no live updates until someone
    reloads it: it starts again without the cursor, reads its view again, and is live."""
    require_chromium()
    port = free_port()
    async with console_daemon(db_dsn, mosquitto, port):
        page, errors = await open_console(browser, f"http://127.0.0.1:{port}")
        await sign_in(page, OPERATOR)
        await expect(page.locator("#alarm-empty")).to_be_visible(timeout=WAIT_MS)
        await publish(mosquitto, "before-1", {"metrics": {"temp": 91}})
        await expect(alarm_row(page, "before-1")).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#live")).to_have_text("reconnecting…", timeout=WAIT_MS)
    # The database it comes back to never had the events the page saw.
    await db.execute("DELETE FROM outbox_event")
    await db.execute("SELECT setval(pg_get_serial_sequence('outbox_event', 'id'), 1, false)")
    await page.evaluate("window.__not_reloaded = true")
    async with console_daemon(db_dsn, mosquitto, port):
        await expect(page.locator("#live")).to_have_text("live", timeout=WAIT_MS)
        await publish(mosquitto, "after-1", {"metrics": {"temp": 92}})
        await expect(alarm_row(page, "after-1")).to_be_visible(timeout=WAIT_MS)
        assert await page.evaluate("window.__not_reloaded") is True
    assert errors.errors == []
