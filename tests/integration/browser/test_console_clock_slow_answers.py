"""The console's idea of the gateway's clock holds when answers turn slow.

The console counts "how long ago" from the gateway's clock, learnt from each answer's `Date`
(test_console_browser_clock.py). It took each answer alone, as if the gateway had stamped it in
the middle of the round trip: on a link that turned slow (a control room's congested uplink,
answers held 6 s on their way back) every answer moved the page's clock 3 s, the wrong way. Each
answer now only narrows the range the earlier ones left (the stamp lies somewhere between the
request and the answer), so slow answers say little and change nothing.

A real browser, its clock ten minutes ahead, against a real daemon, broker and PostgreSQL; the
answers are held by the browser's own network layer (Playwright's routing), the gateway's
`Date` kept.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from urllib.parse import urlparse

import asyncpg
from playwright.async_api import Browser, BrowserContext, Page, Route, expect

from tests.integration.browser.test_console_alarms import Console, publish
from tests.support.api_client import OPERATOR
from tests.support.browser import DESKTOP, WAIT_MS, PageErrors, sign_in
from tests.support.waiting import wait_until

# How long each answer is held on its way back: the slow link itself (a delay the test puts on
# the network, not a wait for anything to happen).
SLOW_S = 10.0
# How far the page's gateway clock may be from the gateway's: `Date` has whole seconds (the
# middle of a range 1 s wide, and as wide again as an answer's round trip), and the
# evaluation's own round trip. 1.2 s held on a quiet machine; with other browser tests beside
# it (CI's workers) the "quick" answers took long enough to put the page 1.4 s off. The fault
# this test guards against puts the page SLOW_S / 2 off (5 s): far outside.
TOLERANCE_MS = 2500.0


async def clock_error_ms(page: Page) -> float:
    """The page's gateway clock (util.js `now()`) less the gateway's (this machine's: the
    daemon runs here), in ms."""
    before = time.time() * 1000
    page_now: float = await page.evaluate("import('/console/util.js').then((m) => m.now())")
    after = time.time() * 1000
    return page_now - (before + after) / 2


async def devices_page_ahead(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> tuple[BrowserContext, Page, PageErrors]:
    """fridge-1 stored; a browser whose clock runs ten minutes ahead, signed in, on the device
    list showing it (its quick answers taught the page the offset)."""
    await publish(console.mosquitto, "fridge-1", {"metrics": {"temp": 4.0}})

    async def stored() -> bool:
        return bool(await db.fetchval("SELECT count(*) FROM device WHERE device_id = 'fridge-1'"))

    await wait_until(stored, timeout=30, message="fridge-1 stored")
    context = await browser.new_context(viewport=DESKTOP)  # type: ignore[arg-type]  # a ViewportSize TypedDict
    page = await context.new_page()
    await page.clock.set_system_time(datetime.now(UTC) + timedelta(minutes=10))
    errors = PageErrors(page)
    await page.goto(f"{console.base}/")
    await sign_in(page, OPERATOR)
    await page.goto(f"{console.base}/#/devices")
    row = page.locator("#device-table tbody tr", has_text="fridge-1")
    await expect(row).to_be_visible(timeout=WAIT_MS)
    return context, page, errors


async def test_slow_answers_do_not_move_the_pages_clock(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    context, page, errors = await devices_page_ahead(console, browser, db)
    row = page.locator("#device-table tbody tr", has_text="fridge-1")
    quick = await clock_error_ms(page)
    assert abs(quick) < TOLERANCE_MS, f"quick answers: the page's clock is {quick:.0f} ms off"

    held: list[str] = []

    def api_answer(url: str) -> bool:
        path = urlparse(url).path
        # The console's own files and the live stream (an answer that never ends) go through.
        return not path.startswith("/console") and not path.startswith("/stream")

    async def slow(route: Route) -> None:
        answer = await route.fetch()  # the gateway stamps its Date now
        await asyncio.sleep(SLOW_S)  # the way back is slow
        held.append(urlparse(route.request.url).path)
        await route.fulfill(response=answer)

    await page.route(api_answer, slow)
    await row.get_by_role("link", name="fridge-1").click()
    detail = page.locator("#device-detail")
    await expect(detail).to_contain_text("fridge-1", timeout=WAIT_MS + SLOW_S * 4000)

    async def answered() -> bool:
        # The device's page asks for the device, then its telemetry and rules: all held.
        return {"/device", "/device/telemetry", "/rules"} <= set(held)

    await wait_until(answered, timeout=60, message="the device page's answers, held")
    slowed = await clock_error_ms(page)
    assert abs(slowed) < TOLERANCE_MS, (
        f"after answers {SLOW_S:.0f} s slow ({sorted(set(held))}) the page's clock is "
        f"{slowed:.0f} ms off (it was {quick:.0f} ms with quick ones)"
    )
    assert errors.errors == []
    await context.close()


async def test_a_clock_set_meanwhile_is_followed(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """The browser's clock set back five minutes (its NTP, a person) while the page is open: the
    next answers' ranges miss the one kept, and the page learns the offset afresh."""
    context, page, errors = await devices_page_ahead(console, browser, db)
    row = page.locator("#device-table tbody tr", has_text="fridge-1")
    assert abs(await clock_error_ms(page)) < TOLERANCE_MS
    await page.clock.set_system_time(datetime.now(UTC) + timedelta(minutes=5))
    await row.get_by_role("link", name="fridge-1").click()
    await expect(page.locator("#device-detail")).to_contain_text("fridge-1", timeout=WAIT_MS)

    async def followed() -> bool:
        return abs(await clock_error_ms(page)) < TOLERANCE_MS

    await wait_until(followed, timeout=30, message="the page's clock after the browser's was set")
    assert errors.errors == []
    await context.close()
