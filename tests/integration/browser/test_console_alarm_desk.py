"""The console's alarm desk in a real browser against a real daemon, broker and PostgreSQL: a
stable list under a stream of alarms (the selected row never moves, new alarms wait behind the
"N new" bar, repaints counted in the page stay at a few a second), the counts header, grouping
with a group expanded, bulk confirm with a result per alarm, and shelving that takes the alarm
out of the view."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import aiomqtt
import msgspec
import pytest
from playwright.async_api import Browser, Page, expect

from protocol import Topics
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, require_chromium, sign_in
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
EXTRA = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"

[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
severity = "CRITICAL"
description = "Too hot."

[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
description = "A door opened."
"""
STREAM = 24  # alarms raised while the operator has one open


@dataclass
class Desk:
    base: str
    mosquitto: Mosquitto


@pytest.fixture
async def desk(db_dsn: str, mosquitto: Mosquitto) -> AsyncIterator[Desk]:
    require_chromium()
    port = free_port()
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=EXTRA)
    async with running_daemon(config):
        yield Desk(f"http://127.0.0.1:{port}", mosquitto)


async def publish_many(mosquitto: Mosquitto, messages: list[tuple[str, dict[str, object]]]) -> None:
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        for device, payload in messages:
            body = {"ts": int(time.time() * 1000), **payload}
            await client.publish(TOPICS.telemetry(device), msgspec.json.encode(body), qos=1)


async def listed(base: str, query: str = "") -> list[dict[str, object]]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{base}/alarms?limit=500{query}", headers={"Authorization": f"Bearer {OPERATOR}"}
        ) as reply,
    ):
        body = await reply.json()
    items: list[dict[str, object]] = body["items"]
    return items


async def repaints(page: Page) -> int:
    return int(await page.evaluate("window.__alarmRepaints"))


async def test_the_selected_row_never_moves_while_alarms_stream_in(
    desk: Desk, browser: Browser
) -> None:
    await publish_many(desk.mosquitto, [(f"door-{n}", {"events": [{"type": "DOOR_OPEN"}]})
                                        for n in range(3)])  # fmt: skip
    await wait_until(lambda: _count(desk.base, 3), message="three alarms raised")
    page, errors = await open_console(browser, desk.base)
    await sign_in(page, OPERATOR)
    rows = page.locator("#alarm-table tbody tr")
    await expect(rows).to_have_count(3, timeout=WAIT_MS)
    chosen = rows.nth(1)
    chosen_id = await chosen.get_attribute("data-alarm-id")
    await chosen.get_by_role("link", name="#").first.click()
    await expect(page.locator("#alarm-detail #alarm-status")).to_be_visible(timeout=WAIT_MS)
    selected = page.locator("#alarm-table tbody tr.selected")
    await expect(selected).to_have_attribute("data-alarm-id", chosen_id or "")
    await chosen.hover()
    box = await selected.bounding_box()
    assert box is not None
    before = await repaints(page)
    started = time.monotonic()

    # CRITICAL alarms, each of which would sort above every row shown: one after another, each
    # raised before the next is sent, so the stream lasts a while (an alarm event every few
    # tens of milliseconds).
    for n in range(STREAM):
        await publish_many(desk.mosquitto, [(f"hot-{n}", {"metrics": {"temp": 90 + n}})])
        await wait_until(lambda n=n: _count(desk.base, 4 + n), message=f"alarm {n} raised")  # type: ignore[misc]
    bar = page.locator("#alarm-new")
    await expect(bar).to_have_text(f"{STREAM} new alarms: show them", timeout=WAIT_MS)
    elapsed = time.monotonic() - started
    painted = await repaints(page) - before
    # At most one read of the list per 0.4 s, whatever the rate (plus the one in flight), and
    # far fewer repaints than alarm events.
    assert painted <= elapsed / 0.4 + 2, (painted, elapsed)
    assert painted < STREAM / 2, (painted, elapsed)
    # Nothing moved: the same three rows, the selected one where it was.
    await expect(rows).to_have_count(3)
    await expect(rows.nth(1)).to_have_attribute("data-alarm-id", chosen_id or "")
    assert await selected.bounding_box() == box
    await expect(page.locator("#alarm-counts")).to_contain_text(f"{STREAM + 3} open")

    await bar.click()
    await expect(rows).to_have_count(STREAM + 3, timeout=WAIT_MS)
    await expect(bar).to_be_hidden()
    # The most severe first, now that the operator asked for them.
    await expect(rows.first).to_contain_text("CRITICAL")
    assert errors.errors == []


async def _count(base: str, n: int) -> bool:
    return len(await listed(base)) == n


async def test_grouping_bulk_confirm_and_shelving(desk: Desk, browser: Browser) -> None:
    await publish_many(desk.mosquitto, [
        ("boiler-1", {"metrics": {"temp": 91}}), ("boiler-2", {"metrics": {"temp": 92}}),
        ("door-1", {"events": [{"type": "DOOR_OPEN"}]}),
    ])  # fmt: skip
    await wait_until(lambda: _count(desk.base, 3), message="three alarms raised")
    alarms = {str(a["device_id"]): int(str(a["id"])) for a in await listed(desk.base)}
    page, errors = await open_console(browser, desk.base)
    await sign_in(page, OPERATOR)
    rows = page.locator("#alarm-table tbody tr")
    await expect(rows).to_have_count(3, timeout=WAIT_MS)
    counts = page.locator("#alarm-counts")
    await expect(counts).to_contain_text("3 open")
    await expect(counts.locator("[data-severity=CRITICAL] .count-active")).to_have_text(
        "active 2/0"
    )

    # Grouped by rule: temp-high holds two, expanded it lists them.
    filters = page.locator("#alarm-filters")
    await filters.get_by_label("Group by").select_option("rule")
    await filters.get_by_role("button", name="Filter").click()
    group = page.locator("#alarm-groups tr.group-row", has_text="temp-high")
    await expect(group.locator(".group-count")).to_have_text("2", timeout=WAIT_MS)
    await expect(group).to_contain_text("CRITICAL")
    await group.get_by_role("button").click()
    members = page.locator("#alarm-groups tr.group-alarm")
    await expect(members).to_have_count(2, timeout=WAIT_MS)
    await expect(members.filter(has_text="boiler-1")).to_have_count(1)
    await filters.get_by_label("Group by").select_option("")
    await filters.get_by_role("button", name="Filter").click()
    await expect(rows).to_have_count(3, timeout=WAIT_MS)

    # Bulk confirm: the boilers; one of them confirmed meanwhile by someone else is refused.
    for device in ("boiler-1", "boiler-2"):
        await rows.filter(has_text=device).get_by_role("checkbox").check()
    await expect(page.locator("#bulk-count")).to_have_text("2 alarms selected:")
    async with aiohttp.ClientSession() as http:
        reply = await http.post(
            f"{desk.base}/alarms/{alarms['boiler-2']}/confirm", json={},
            headers={"Authorization": f"Bearer {OPERATOR}"},
        )  # fmt: skip
        assert reply.status == 200
    await page.get_by_role("button", name="Confirm selected").click()
    results = page.locator("#bulk-results li")
    await expect(results).to_have_count(2, timeout=WAIT_MS)
    await expect(results.filter(has_text=f"#{alarms['boiler-1']}: CONFIRMED")).to_have_count(1)
    refused = results.filter(has_text=f"#{alarms['boiler-2']}: refused")
    await expect(refused).to_contain_text("STATUS_CHANGED")
    await expect(refused).to_contain_text("already confirmed by olga")
    await expect(page.locator("#bulk-bar")).to_be_hidden()
    await expect(rows.filter(has_text="boiler-1")).to_contain_text("CONFIRMED")

    # Shelve the door alarm: it leaves the list, the header counts it shelved.
    door = rows.filter(has_text="door-1")
    await door.get_by_role("link", name="#").first.click()
    detail = page.locator("#alarm-detail")
    await detail.get_by_label("Reason").fill("door sensor being replaced")
    await detail.get_by_role("button", name="Shelve").click()
    await expect(rows.filter(has_text="door-1")).to_have_count(0, timeout=WAIT_MS)
    await expect(rows).to_have_count(2)
    await expect(detail.locator(".shelved")).to_be_visible(timeout=WAIT_MS)
    await expect(counts.locator(".count-total-shelved")).to_have_text("shelved 1")
    # Shown again with the filter, and lifted.
    await filters.get_by_label("Shelved").select_option("true")
    await filters.get_by_role("button", name="Filter").click()
    await expect(rows).to_have_count(1, timeout=WAIT_MS)
    await expect(rows.first).to_contain_text("door-1")
    await detail.get_by_role("button", name="Unshelve").click()
    await expect(detail.locator(".shelved")).to_have_count(0, timeout=WAIT_MS)
    await expect(counts.locator(".count-total-shelved")).to_have_text("shelved 0")

    # Out of service, from the device's page: shown there, and on its next alarm.
    await page.goto(f"{desk.base}/#/devices/door-1")
    await expect(page.locator("#device-detail h3").first).to_have_text("door-1", timeout=WAIT_MS)
    device = page.locator("#device-detail")
    await device.get_by_label("Maintenance reason").fill("hinge repair")
    await device.get_by_role("button", name="Put out of service").click()
    await expect(device.locator(".out-of-service")).to_contain_text(
        "out of service since", timeout=WAIT_MS
    )
    await expect(device.locator(".out-of-service")).to_contain_text("hinge repair (olga)")
    await publish_many(desk.mosquitto, [("door-1", {"events": [{"type": "DOOR_OPEN"}]})])
    await page.goto(f"{desk.base}/#/alarms")
    await filters.get_by_label("Shelved").select_option("false")
    await filters.get_by_role("button", name="Filter").click()
    # Its new alarm (the first one, nobody attended, is superseded by it).
    await expect(rows.filter(has_text="door-1").locator(".tag-oos")).to_have_text(
        "out of service", timeout=WAIT_MS
    )
    await expect(counts.locator(".count-oos")).to_have_text("out of service 1")
    assert errors.errors == []
