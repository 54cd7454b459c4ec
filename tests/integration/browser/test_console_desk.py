"""The operator tasks of the console in a real browser, against a real daemon, broker and
PostgreSQL: a campaign started from its form (a live count of the selector's devices, a
confirmation naming how many), a command sent from a device's page and from the commands form
without a device chosen first, the dead letters' payloads, replay only where it can ever work,
a failed replay shown as one, a discard (audited), and a device chart opened on an alarm's
metric with its rule's threshold and clear lines, a time range and the value under the
pointer."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import aiomqtt
import asyncpg
import msgspec
import pytest
from playwright.async_api import Browser, expect

from protocol import Topics
from storage import ingest as repo
from storage.ingest import DeadLetterRow
from tests.support.api_client import ADMIN, OPERATOR, VIEWER, ApiClient
from tests.support.browser import WAIT_MS, open_console, sign_in
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
CONFIG = f"""
[[api.tokens]]
name = "vera"
token = "{VIEWER}"
role = "viewer"

[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"

[[api.tokens]]
name = "root"
token = "{ADMIN}"
role = "admin"

[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
severity = "CRITICAL"
"""


@pytest.fixture
async def api(base: str) -> AsyncIterator[ApiClient]:
    async with aiohttp.ClientSession() as http:
        yield ApiClient(base=base, http=http)


async def publish(mosquitto: Mosquitto, device: str, *payloads: bytes) -> None:
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        for payload in payloads:
            await client.publish(TOPICS.telemetry(device), payload, qos=1)


def telemetry(ts_ms: int | None = None, **fields: object) -> bytes:
    return msgspec.json.encode({"ts": ts_ms or int(time.time() * 1000), **fields})


async def fetchval(dsn: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def known(dsn: str, *devices: str) -> bool:
    found = await fetchval(
        dsn, "SELECT count(*) FROM device WHERE device_id = ANY($1::text[])", list(devices)
    )
    return bool(found == len(devices))


async def test_a_campaign_is_started_from_the_form_after_a_live_count_and_a_confirmation(
    base: str, db_dsn: str, api: ApiClient, mosquitto: Mosquitto, browser: Browser
) -> None:
    devices = ["pump-1", "pump-2", "pump-3", "fan-1", "other-1"]
    for device in devices:
        await publish(mosquitto, device, telemetry(metrics={"rpm": 10}))
    await wait_until(lambda: known(db_dsn, *devices), timeout=30, message="devices known")
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.get_by_role("link", name="Campaigns").click()
    form = page.locator("#campaign-create")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    count = page.locator("#campaign-target-count")
    # The count follows the selector as it is typed.
    await form.get_by_label("Targets (selector)").fill("pump-*")
    await expect(count).to_have_text("3 devices match: pump-1, pump-2, pump-3", timeout=WAIT_MS)
    await form.get_by_label("Targets (selector)").fill("pump-*, fan-1")
    await expect(count).to_contain_text("4 devices match", timeout=WAIT_MS)
    await form.get_by_label("Targets (selector)").fill("nothing-*")
    await expect(count).to_have_text("No device that takes commands matches.", timeout=WAIT_MS)
    await form.get_by_label("Targets (selector)").fill("bad id")
    await expect(count).to_contain_text("Not a selector", timeout=WAIT_MS)
    await form.get_by_label("Targets (selector)").fill("pump-*,fan-1")
    await form.get_by_label("Command", exact=True).fill("reboot")
    await form.get_by_label("Params (JSON object)").fill('{"delay_s": 2}')
    await form.get_by_label("Rollout: commands per minute").fill("120")
    await form.get_by_label("Abort when failed").fill("50")
    await form.get_by_label("once finished").fill("2")
    before = await fetchval(db_dsn, "SELECT count(*) FROM campaign")
    await form.get_by_role("button", name="Review campaign").click()
    confirm = page.locator("#campaign-confirm")
    await expect(confirm).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#campaign-confirm-text")).to_have_text("Send “reboot” to 4 devices?")
    await expect(page.locator("#campaign-confirm-detail")).to_contain_text("at most 120 per minute")
    # Nothing is created before the confirmation; Back changes nothing either.
    assert await fetchval(db_dsn, "SELECT count(*) FROM campaign") == before
    await page.get_by_role("button", name="Back").click()
    await expect(confirm).to_be_hidden()
    await form.get_by_role("button", name="Review campaign").click()
    await expect(confirm).to_be_visible(timeout=WAIT_MS)
    await page.get_by_role("button", name="Start campaign").click()
    await expect(page.locator("#notice")).to_contain_text("started: 4 commands", timeout=WAIT_MS)
    await expect(confirm).to_be_hidden()
    row = page.locator("#campaign-table tbody tr").first
    await expect(row).to_contain_text("reboot", timeout=WAIT_MS)
    await expect(row).to_contain_text("/ 4 finished")
    await expect(row).to_contain_text("by olga")
    listed = await api.call("GET", "/campaigns", token=VIEWER)
    assert len(listed.body["items"]) == before + 1
    campaign = listed.body["items"][0]
    assert (campaign["name"], campaign["params"], campaign["target_selector"]) == (
        "reboot", {"delay_s": 2}, ["pump-*", "fan-1"],
    )  # fmt: skip
    assert (campaign["per_minute"], campaign["failure_ratio"], campaign["min_finished"]) == (
        120, 0.5, 2,
    )  # fmt: skip
    assert campaign["created_by"] == "olga"
    assert errors.errors == []


async def test_a_viewer_gets_no_campaign_form(base: str, browser: Browser) -> None:
    page, errors = await open_console(browser, base)
    await sign_in(page, VIEWER)
    await page.get_by_role("link", name="Campaigns").click()
    await expect(page.locator("#campaign-table")).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#campaign-create")).to_be_hidden()
    assert errors.errors == []


async def test_a_command_is_sent_from_a_devices_page_and_from_the_form_without_a_device(
    base: str, db_dsn: str, api: ApiClient, mosquitto: Mosquitto, browser: Browser
) -> None:
    await publish(mosquitto, "valve-4", telemetry(metrics={"open": 1}))
    await wait_until(lambda: known(db_dsn, "valve-4"), timeout=30, message="valve-4 known")
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/devices/valve-4")
    section = page.locator("#device-detail .device-commands")
    await expect(section).to_be_visible(timeout=WAIT_MS)
    await section.get_by_label("Command", exact=True).fill("close")
    await section.get_by_label("Params (JSON object)").fill('{"force": true}')
    await section.get_by_role("button", name="Send command").click()
    await expect(section.locator(".command-result")).to_contain_text("sent", timeout=WAIT_MS)
    sent = await api.call("GET", "/devices/valve-4/commands", token=VIEWER)
    assert [(c["name"], c["params"], c["created_by"]) for c in sent.body["items"]] == [
        ("close", {"force": True}, "olga")
    ]
    await section.get_by_role("link", name="Follow it in Commands").click()
    await expect(page.locator("#command-table tbody tr").first).to_contain_text(
        "close", timeout=WAIT_MS
    )

    # The commands section: the form is there before any device is chosen.
    await page.goto(f"{base}/#/commands")
    form = page.locator("#command-create")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    await expect(form.get_by_label("To device")).to_have_value("valve-4")
    await form.get_by_label("To device").fill("valve-5")
    await form.get_by_label("Name").fill("open")
    await form.get_by_role("button", name="Send").click()
    await expect(page.locator("#notice")).to_contain_text("to valve-5 created", timeout=WAIT_MS)
    rows = page.locator("#command-table tbody tr")
    await expect(rows).to_have_count(1, timeout=WAIT_MS)
    await expect(rows.first).to_contain_text("valve-5")
    await expect(page).to_have_url(f"{base}/#/commands/valve-5")
    assert errors.errors == []


async def test_dead_letters_show_their_payload_replay_only_where_it_can_work_and_are_discarded(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    # Bytes that are no JSON: MALFORMED, never replayable.
    await publish(mosquitto, "broken-7", b"\x00\xffbad")
    # Refused by PostgreSQL earlier, and invalid for today's decoder: a replay that fails.
    invalid = b'{"ts": "not a time", "metrics": {"temp": "x"}}'
    conn = await asyncpg.connect(db_dsn)
    try:
        await repo.insert_dead_letters(
            conn,
            [DeadLetterRow.whole(TOPICS.telemetry("late-3"), invalid, "STORAGE_REJECTED", "then")],
            "earlier-node",
        )
    finally:
        await conn.close()
    page, errors = await open_console(browser, base)
    await sign_in(page, ADMIN)
    await page.get_by_role("link", name="Dead letters").click()
    malformed = page.locator("#dead-letter-table tbody tr", has_text="broken-7")
    await expect(malformed).to_contain_text("MALFORMED", timeout=WAIT_MS)
    await expect(malformed.get_by_role("button", name="Replay")).to_have_count(0)
    await expect(malformed.locator(".not-replayable")).to_have_text("cannot be replayed")
    # Its payload: bytes in hex, and no text (not UTF-8).
    await malformed.get_by_role("link", name="View").click()
    detail = page.locator("#dead-letter-detail")
    await expect(detail.locator(".payload-hex")).to_contain_text(
        "00000000  00 ff 62 61 64", timeout=WAIT_MS
    )
    await expect(detail.locator(".payload-hex")).to_contain_text("..bad")
    await expect(detail.locator(".payload-text-none")).to_be_visible()
    await expect(detail.get_by_role("button", name="Replay")).to_have_count(0)
    await expect(detail.locator(".not-replayable")).to_contain_text("neither JSON nor MessagePack")

    # A replayable letter whose replay fails: shown as a failure, the letter stays.
    late = page.locator("#dead-letter-table tbody tr", has_text="late-3")
    await late.get_by_role("link", name="View").click()
    await expect(detail.locator(".payload-text")).to_have_text(invalid.decode(), timeout=WAIT_MS)
    await detail.get_by_role("button", name="Replay").click()
    notice = page.locator("#notice")
    await expect(notice).to_contain_text("failed: still_invalid", timeout=WAIT_MS)
    await expect(notice).not_to_have_class("notice ok")
    await expect(late.locator(".replayed")).to_contain_text("failed: still_invalid")
    await expect(late).to_have_class("failed selected")
    await expect(detail.locator(".replay-failed")).to_contain_text("failed")

    # Discarded after a confirmation: gone from the list, and audited with the token's name.
    letter_id = int(await late.get_attribute("data-dead-letter-id") or 0)
    await detail.get_by_role("button", name="Discard…").click()
    await detail.get_by_role("button", name="Keep it").click()
    await expect(late).to_be_visible()
    await detail.get_by_role("button", name="Discard…").click()
    await detail.get_by_role("button", name="Discard dead letter").click()
    await expect(notice).to_contain_text(
        f"Dead letter {letter_id} discarded by root", timeout=WAIT_MS
    )
    await expect(late).to_have_count(0)
    await expect(detail).to_be_hidden()
    await expect(malformed).to_be_visible()
    audit = await fetchval(
        db_dsn, "SELECT actor FROM dead_letter_audit WHERE dead_letter_id = $1", letter_id
    )
    assert audit == "root"
    assert errors.errors == []


async def test_the_chart_opens_on_the_alarms_metric_with_its_rules_lines(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    # "humidity" sorts first: without ?metric= the chart would open on it.
    now = int(time.time() * 1000)
    readings = [70.0, 78.5, 85.25, 74.0]
    await publish(
        mosquitto,
        "boiler-2",
        *(
            telemetry(now - (len(readings) - n) * 1000, metrics={"temp": v, "humidity": 40 + n})
            for n, v in enumerate(readings)
        ),
    )
    await wait_until(
        lambda: fetchval(db_dsn, "SELECT count(*) FROM alarm WHERE device_id = 'boiler-2'"),
        timeout=30,
        message="temp-high raised",
    )
    alarm_id = await fetchval(db_dsn, "SELECT min(id) FROM alarm WHERE device_id = 'boiler-2'")
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    # The alarm leads there: its detail links to the device's chart on the alarm's metric.
    await page.goto(f"{base}/#/alarms/{alarm_id}")
    link = page.locator("#alarm-detail a.alarm-chart")
    await expect(link).to_have_text("temp on boiler-2", timeout=WAIT_MS)
    await link.click()
    await expect(page).to_have_url(re.compile(r"#/devices/boiler-2\?metric=temp&rule=temp-high$"))
    box = page.locator("#device-detail .chart-box")
    await expect(box.locator("h3")).to_have_text("temp, last 4 values", timeout=WAIT_MS)
    chart = box.locator("svg.chart")
    assert len((await chart.locator("polyline").get_attribute("points") or "").split()) == 4
    await expect(chart.locator(".rule-trigger")).to_have_attribute("data-value", "80")
    await expect(chart.locator(".rule-clear")).to_have_attribute("data-value", "75")
    await expect(chart.locator(".rule-trigger text")).to_have_text("temp-high: fires > 80")
    await expect(chart.locator(".rule-clear text")).to_have_text("temp-high: clears at 75")
    # The trigger line is above the clear line, both inside the chart.
    trigger_y = float(await chart.locator(".rule-trigger line").get_attribute("y1") or "nan")
    clear_y = float(await chart.locator(".rule-clear line").get_attribute("y1") or "nan")
    assert 0 < trigger_y < clear_y < 200, (trigger_y, clear_y)
    # Values under the pointer: the right edge is the newest reading, the left the oldest.
    frame = await chart.bounding_box()
    assert frame is not None
    await page.mouse.move(frame["x"] + frame["width"] - 12, frame["y"] + frame["height"] / 2)
    await expect(chart.locator("text.readout")).to_contain_text("74 at ", timeout=WAIT_MS)
    await page.mouse.move(frame["x"] + 50, frame["y"] + frame["height"] / 2)
    await expect(chart.locator("text.readout")).to_contain_text("70 at ", timeout=WAIT_MS)
    # The readout's date is the one format of every page: ISO 8601 order, local time.
    readout = await chart.locator("text.readout").text_content() or ""
    assert re.fullmatch(r"70 at \d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}", readout), readout
    # And from the keyboard (the pointer gone: its readout goes with it).
    await page.mouse.move(frame["x"] + frame["width"] / 2, frame["y"] - 40)
    await expect(chart.locator("text.readout")).to_have_text("")
    await chart.focus()
    await page.keyboard.press("ArrowRight")
    await expect(chart.locator("text.readout")).to_contain_text("70 at ")
    await page.keyboard.press("ArrowRight")
    await expect(chart.locator("text.readout")).to_contain_text("78.5 at ")
    # A time range: the last hour holds the same four readings.
    await box.get_by_label("Time range").select_option("1h")
    await expect(box.locator("h3")).to_have_text("temp, 4 values, last hour", timeout=WAIT_MS)
    # Another metric's button: its chart, with no threshold line (no rule on it).
    await page.get_by_role("button", name="Chart humidity").click()
    await expect(box.locator("h3")).to_contain_text("humidity", timeout=WAIT_MS)
    await expect(box.locator(".rule-line")).to_have_count(0)
    assert errors.errors == []
