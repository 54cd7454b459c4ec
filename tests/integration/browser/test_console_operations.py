"""The console's devices, commands and dead letters in a real browser, against a real daemon,
broker (with simulated devices answering commands) and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from datetime import UTC, datetime

import aiohttp
import aiomqtt
import asyncpg
import msgspec
from playwright.async_api import Browser, expect

from protocol import Topics
from sim.responder import Responder, Script
from storage import ingest as repo
from storage.ingest import DeadLetterRow
from tests.support.api_client import ADMIN, OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
CONFIG = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"

[[api.tokens]]
name = "root"
token = "{ADMIN}"
role = "admin"

[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
"""


async def publish(mosquitto: Mosquitto, device: str, payload: bytes) -> None:
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        await client.publish(TOPICS.telemetry(device), payload, qos=1)


def telemetry(**fields: object) -> bytes:
    return msgspec.json.encode({"ts": int(time.time() * 1000), **fields})


async def stored(dsn: str, device: str, count: int) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        found = await conn.fetchval("SELECT count(*) FROM telemetry WHERE device_id = $1", device)
    finally:
        await conn.close()
    return bool(found >= count)


async def test_a_device_page_shows_the_latest_value_and_its_chart(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    # Three readings a millisecond apart at least, oldest first; the page shows the last.
    began = datetime.now(UTC)
    start = int(time.time() * 1000) - 3000
    for offset, value in enumerate((21.5, 22.0, 23.25)):
        body = {"ts": start + offset * 1000, "metrics": {"temp": value, "humidity": 40 + offset}}
        await publish(mosquitto, "lab-7", msgspec.json.encode(body))
    await wait_until(lambda: stored(db_dsn, "lab-7", 3), timeout=30, message="3 samples stored")
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.get_by_role("link", name="Devices").click()
    row = page.locator("#device-table tbody tr", has_text="lab-7")
    await expect(row).to_be_visible(timeout=WAIT_MS)
    # Telemetry alone says nothing of presence (no status message): unknown, seen since the
    # test began. Said relative to the browser's clock ("just now" under 5 s, then "N s
    # ago"): a slow machine can take 5 s from the last sample to this row, so the text is
    # held to the seconds' forms and the time itself to the test's span.
    await expect(row).to_contain_text("unknown")
    seen = row.locator("time")
    await expect(seen).to_have_text(re.compile(r"^(just now|\d+ s ago)$"))
    seen_at = datetime.fromisoformat(await seen.get_attribute("datetime") or "")
    assert began <= seen_at <= datetime.now(UTC), (began, seen_at)
    await row.get_by_role("link", name="lab-7").click()
    temp = page.locator("#device-detail .metric[data-metric='temp'] .value")
    await expect(temp).to_have_text("23.25", timeout=WAIT_MS)
    chart = page.locator("#device-detail svg.chart polyline")
    await expect(chart).to_have_count(1, timeout=WAIT_MS)
    points = (await chart.get_attribute("points") or "").split()
    assert len(points) == 3, points
    # Another metric's chart, by its button.
    await page.get_by_role("button", name="Chart humidity").click()
    await expect(page.locator("#device-detail .chart-box h3")).to_contain_text(
        "humidity", timeout=WAIT_MS
    )
    # A newer reading shows on Refresh.
    await publish(mosquitto, "lab-7", telemetry(metrics={"temp": 24.5}))
    await wait_until(lambda: stored(db_dsn, "lab-7", 4), timeout=30, message="4th sample")
    await page.get_by_role("button", name="Refresh").click()
    await expect(temp).to_have_text("24.5", timeout=WAIT_MS)
    assert errors.errors == []


async def test_a_command_created_on_the_page_reaches_acked_live(
    base: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    responder = Responder(host="127.0.0.1", port=mosquitto.port, topics=TOPICS, script=Script())
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop))
    try:
        async with asyncio.timeout(30):
            await responder.wait_subscribed()
        page, errors = await open_console(browser, base)
        await sign_in(page, OPERATOR)
        await page.goto(f"{base}/#/commands/pump-3")
        form = page.locator("#command-create")
        await expect(form).to_be_visible(timeout=WAIT_MS)
        await form.get_by_label("Name").fill("reboot")
        await form.get_by_label("Params (JSON object)").fill('{"delay_s": 1}')
        await form.get_by_role("button", name="Send").click()
        row = page.locator("#command-table tbody tr").first
        await expect(row).to_contain_text("reboot", timeout=WAIT_MS)
        await expect(row.locator(".status")).to_have_text("ACKED", timeout=WAIT_MS)
        await expect(row).to_contain_text("olga")  # the token's name
        assert [c.name for c in responder.received] == ["reboot"]
        # Params that are not an object are refused on the page, nothing is sent.
        await form.get_by_label("Params (JSON object)").fill("[1]")
        await form.get_by_role("button", name="Send").click()
        await expect(page.locator("#notice")).to_contain_text("JSON object")
        await expect(page.locator("#command-table tbody tr")).to_have_count(1)
        assert errors.errors == []
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await answering


async def test_a_command_is_cancelled_from_the_page(
    base: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    # No device answers: the command stays open until cancelled.
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/commands/quiet-1")
    form = page.locator("#command-create")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    await form.get_by_label("Name").fill("open-valve")
    await form.get_by_label("Delivery").select_option("deferrable")
    await form.get_by_role("button", name="Send").click()
    row = page.locator("#command-table tbody tr").first
    await expect(row).to_contain_text("open-valve", timeout=WAIT_MS)
    await row.get_by_role("button", name="Cancel").click()
    await expect(row.locator(".status")).to_have_text("CANCELLED", timeout=WAIT_MS)
    await expect(row.get_by_role("button")).to_have_count(0)
    assert errors.errors == []


async def test_a_command_to_a_sparkplug_device_is_sent_and_listed_from_the_page(
    base: str, db_dsn: str, browser: Browser
) -> None:
    """The form's "To device" takes a Sparkplug id (`{group}/{node}/{device}`): the console
    sends it in the body (`POST /commands`) and lists that device's commands by query."""
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/commands")
    form = page.locator("#command-create")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    await form.get_by_label("To device").fill("Plant1/Line4/Oven")
    await form.get_by_label("Name").fill("setpoint")
    await form.get_by_label("Params").fill('{"value": 42.5}')
    await form.get_by_label("Delivery").select_option("deferrable")
    await form.get_by_role("button", name="Send").click()
    await expect(page).to_have_url(f"{base}/#/commands/Plant1%2FLine4%2FOven", timeout=WAIT_MS)
    row = page.locator("#command-table tbody tr").first
    await expect(row).to_contain_text("setpoint", timeout=WAIT_MS)
    await expect(row).to_contain_text("Plant1/Line4/Oven")
    await expect(page.locator("#command-table tbody tr")).to_have_count(1)
    conn = await asyncpg.connect(db_dsn)
    try:
        stored = await conn.fetch("SELECT device_id, name, params::text, created_by FROM command")
    finally:
        await conn.close()
    assert [tuple(r) for r in stored] == [
        ("Plant1/Line4/Oven", "setpoint", '{"value": 42.5}', "olga")
    ]
    assert errors.errors == []


async def test_the_fleets_commands_are_listed_live_and_filtered_by_status(
    base: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    # Nobody answers: the commands stay open until cancelled.
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    async with aiohttp.ClientSession(base, headers=auth) as http:

        async def send(device: str, name: str) -> int:
            async with http.post(f"/devices/{device}/commands", json={"name": name}) as reply:
                assert reply.status == 201, await reply.text()
                command_id: int = (await reply.json())["command"]["id"]
                return command_id

        first = await send("quiet-1", "open-valve")
        second = await send("quiet-2", "close-valve")
        page, errors = await open_console(browser, base)
        await sign_in(page, OPERATOR)
        await page.goto(f"{base}/#/commands")
        rows = page.locator("#command-table tbody tr")
        await expect(rows).to_have_count(2, timeout=WAIT_MS)
        await expect(rows.nth(0)).to_contain_text("quiet-2")  # newest first
        await expect(rows.nth(1)).to_contain_text("quiet-1")
        # Cancelled elsewhere (through the API): the page follows by itself.
        async with http.post(f"/commands/{first}/cancel") as reply:
            assert reply.status == 200, await reply.text()
        await expect(rows.nth(1).locator(".status")).to_have_text("CANCELLED", timeout=WAIT_MS)
        picker = page.locator("#command-device")
        await picker.get_by_label("Status").select_option("CANCELLED")
        await picker.get_by_role("button", name="Show commands").click()
        await expect(rows).to_have_count(1, timeout=WAIT_MS)
        await expect(rows.first).to_contain_text(str(first))
        # A device's link narrows the list to that device.
        await rows.first.get_by_role("link", name="quiet-1").click()
        await expect(page).to_have_url(f"{base}/#/commands/quiet-1")
        await expect(page.locator("#command-create")).to_be_visible(timeout=WAIT_MS)
        assert second > first
        assert errors.errors == []


async def test_a_dead_letter_is_listed_and_replayed_from_the_page(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    # What the daemon refuses now: bytes that are no telemetry.
    await publish(mosquitto, "broken-1", b"{not json")
    # What PostgreSQL refused earlier: valid bytes, replayable.
    door = telemetry(events=[{"type": "DOOR_OPEN"}])
    conn = await asyncpg.connect(db_dsn)
    try:
        await repo.insert_dead_letters(
            conn,
            [DeadLetterRow.whole(TOPICS.telemetry("door-5"), door, "STORAGE_REJECTED", "then")],
            "earlier-node",
        )
    finally:
        await conn.close()
    page, errors = await open_console(browser, base)
    await sign_in(page, ADMIN)
    await expect(page.locator("#nav-dead-letters")).to_be_visible()
    await page.get_by_role("link", name="Dead letters").click()
    malformed = page.locator("#dead-letter-table tbody tr", has_text="broken-1")
    await expect(malformed).to_contain_text("MALFORMED", timeout=WAIT_MS)
    await expect(malformed).to_contain_text("9 B")
    letter = page.locator("#dead-letter-table tbody tr", has_text="door-5")
    await expect(letter).to_contain_text("STORAGE_REJECTED")
    await expect(letter.locator(".replayed")).to_have_text("no")
    await letter.get_by_role("button", name="Replay").click()
    await expect(page.locator("#notice")).to_contain_text("replayed", timeout=WAIT_MS)
    await expect(letter.locator(".replayed")).not_to_have_text("no", timeout=WAIT_MS)
    # Re-ingested through the normal path: the rule raised its alarm.
    await page.get_by_role("link", name="Alarms").click()
    await expect(page.locator("#alarm-table tbody tr", has_text="door-5")).to_be_visible(
        timeout=WAIT_MS
    )
    assert errors.errors == []


async def test_an_operator_does_not_get_the_dead_letters(base: str, browser: Browser) -> None:
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await expect(page.locator("#nav-dead-letters")).to_be_hidden()
    await page.goto(f"{base}/#/dead-letters")
    await expect(page.locator("#view-alarms")).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#view-dead-letters")).to_be_hidden()
    assert errors.errors == []
