"""A console page left open while alarms come and go, in a real browser against a real daemon,
broker and PostgreSQL: what it keeps of the alarms that left its list."""

from __future__ import annotations

from playwright.async_api import Browser, Page, expect

from tests.integration.browser.conftest import Console
from tests.integration.browser.test_console_alarm_desk import publish_many
from tests.integration.browser.test_console_alarms import api
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in

BATCH = 10
ROUNDS = 4


async def _dom_nodes(page: Page) -> int:
    """The page's DOM nodes, attached or not, once garbage is collected (what it holds on to)."""
    cdp = await page.context.new_cdp_session(page)
    await cdp.send("HeapProfiler.collectGarbage")
    counters = await cdp.send("Memory.getDOMCounters")
    await cdp.detach()
    return int(counters["nodes"])


async def _a_round(console: Console, page: Page, n: int) -> None:
    """BATCH alarms raised, shown, marked false by someone else, and gone from the list."""
    devices = [f"door-{n}-{i}" for i in range(BATCH)]
    await publish_many(
        console.mosquitto, [(d, {"events": [{"type": "DOOR_OPEN"}]}) for d in devices]
    )
    rows = page.locator("#alarm-table tbody tr")
    await expect(rows).to_have_count(BATCH, timeout=WAIT_MS)
    # The open page's stream pushes each alarm (NEW → PUSHED, system:stream, behaviour §5) in
    # the node's next round. Act once the page shows them all pushed: the system has nothing
    # more to do to them, and what is checked is the long-open page's rows, not that race
    # (a step the push overtakes applies from PUSHED: services/test_alarm_action_after_push.py).
    await expect(rows.locator(".status")).to_have_text(["PUSHED"] * BATCH, timeout=WAIT_MS)
    ids = [int(i) for i in await rows.evaluate_all("rs => rs.map(r => r.dataset.alarmId)")]
    reply = await api(
        console.base, "POST", "/alarms/bulk", OPERATOR, {"action": "false", "ids": ids}
    )
    assert isinstance(reply, dict)
    assert [item for item in reply["items"] if not item["ok"]] == []
    await expect(rows).to_have_count(0, timeout=WAIT_MS)


async def test_a_page_left_open_does_not_keep_every_alarm_it_ever_showed(
    console: Console, browser: Browser
) -> None:
    """docs/console.md: the page is for a control room's screen, open all day. Alarms come and
    go; a row whose alarm left the list (marked false, closed, filtered out) must not be kept
    for ever: a page that holds every row it ever drew grows by thousands of DOM nodes an
    hour on a busy site (a chattering device raises six a minute) until the tab dies."""
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    await expect(page.locator("#alarm-empty")).to_be_visible(timeout=WAIT_MS)
    await _a_round(console, page, 0)
    before = await _dom_nodes(page)
    for n in range(1, ROUNDS + 1):
        await _a_round(console, page, n)
    after = await _dom_nodes(page)
    assert after - before < BATCH * 5, (
        f"{ROUNDS * BATCH} alarms came and went, and the page holds {after - before} more "
        f"DOM nodes ({before} → {after})"
    )
    assert errors.errors == []
