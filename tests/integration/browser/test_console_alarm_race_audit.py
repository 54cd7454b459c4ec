"""The console when its operator loses a race to another operator's different step, in a real
browser against a real daemon, broker and PostgreSQL: the other step's transaction is held open
on a second connection until the console's action waits for it."""

from __future__ import annotations

import asyncpg
from playwright.async_api import Browser, expect

from gateway.alarms.lifecycle import transition
from gateway.domain.alarm import Action
from tests.integration.browser.test_console_alarms import (
    Console,
    alarm_row,
    publish,
)
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in
from tests.support.waiting import wait_until


async def test_a_handle_that_lost_to_a_confirm_says_who_confirmed_not_that_they_handled(
    console: Console, browser: Browser, db_dsn: str, db: asyncpg.Connection
) -> None:
    """Olga presses "Mark handled" while ivan's confirm is being written: her request read the
    alarm PUSHED and waited for his; it lost (409 `STATUS_CHANGED`, actor ivan). The page must
    say that ivan confirmed it first, not that "ivan already did this" (he did not handle it)."""
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    # Signed in first: the page's stream writes the alarm's creation, and so pushes it.
    await expect(page.locator("#alarm-empty")).to_be_visible(timeout=WAIT_MS)
    await publish(console.mosquitto, "door-9", {"events": [{"type": "DOOR_OPEN"}]})
    row = alarm_row(page, "door-9")
    await expect(row).to_be_visible(timeout=WAIT_MS)
    alarm_id = int(await row.get_attribute("data-alarm-id") or 0)

    async def pushed() -> bool:
        status = await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id)
        return bool(status == "PUSHED")

    await wait_until(pushed, message="the console's stream pushed the alarm")
    await page.goto(f"{console.base}/#/alarms/{alarm_id}")
    detail = page.locator("#alarm-detail")
    handle = detail.get_by_role("button", name="Mark handled")
    await expect(handle).to_be_visible(timeout=WAIT_MS)

    async def a_request_waits() -> bool:
        return bool(
            await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        )

    ivan = await asyncpg.connect(db_dsn)
    try:
        held = ivan.transaction()
        await held.start()
        await transition(ivan, alarm_id, Action.CONFIRM, actor="ivan", node_id="other-node")
        async with page.expect_response(lambda r: r.request.method == "POST") as answer:
            await handle.click()
            await wait_until(a_request_waits, message="olga's handle waits for ivan's confirm")
            await held.commit()
        assert (await answer.value).status == 409
    finally:
        await ivan.close()
    await expect(page.locator("#notice")).to_have_text(
        "ivan acted first (confirm): the alarm is now CONFIRMED.", timeout=WAIT_MS
    )
    await expect(detail.locator("#alarm-status")).to_have_text("CONFIRMED", timeout=WAIT_MS)
    assert errors.errors == []
