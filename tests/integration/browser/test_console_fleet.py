"""The console's campaigns and notifications in a real browser, against a real daemon, broker
(with simulated devices answering commands), a webhook receiver that cannot be reached, and
PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import aiohttp
import aiomqtt
import msgspec
import pytest
from playwright.async_api import Browser, Page, expect

from protocol import Topics
from sim.responder import Behaviour, Responder, Script
from tests.support.api_client import OPERATOR, VIEWER, ApiClient
from tests.support.browser import (
    PHONE,
    WAIT_MS,
    open_console,
    require_chromium,
    sign_in,
)
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")


def config(closed_port: int) -> str:
    return f"""
[[api.tokens]]
name = "vera"
token = "{VIEWER}"
role = "viewer"

[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"

[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"

[notify]
max_attempts = 1

[[notify.receivers]]
name = "nowhere"
kind = "webhook"
url = "http://127.0.0.1:{closed_port}/hook"
timeout_s = 5

[[notify.routes]]
events = ["alarm.created"]
receivers = ["nowhere"]
"""


@pytest.fixture
async def base(db_dsn: str, mosquitto: Mosquitto) -> AsyncIterator[str]:
    require_chromium()
    port = free_port()
    # Nothing listens there: every send is a refused connection.
    extra = config(free_port())
    cfg = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=extra)
    async with running_daemon(cfg):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
async def api(base: str) -> AsyncIterator[ApiClient]:
    async with aiohttp.ClientSession() as http:
        yield ApiClient(base=base, http=http)


@contextlib.asynccontextmanager
async def answering(mosquitto: Mosquitto, script: Script) -> AsyncIterator[Responder]:
    responder = Responder(host="127.0.0.1", port=mosquitto.port, topics=TOPICS, script=script)
    stop = asyncio.Event()
    task = asyncio.create_task(responder.run(stop))
    try:
        async with asyncio.timeout(30):
            await responder.wait_subscribed()
        yield responder
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await task


async def start_campaign(api: ApiClient, name: str, devices: list[str]) -> dict[str, Any]:
    reply = await api.call(
        "POST", "/campaigns", token=OPERATOR, json={"name": name, "targets": {"devices": devices}}
    )
    assert reply.status == 201, reply.body
    campaign: dict[str, Any] = reply.body["campaign"]
    return campaign


def campaign_row(page: Page, campaign_id: int) -> Any:
    return page.locator(f"#campaign-table tbody tr[data-campaign-id='{campaign_id}']")


async def test_a_campaign_shows_its_counts_reaching_acked_live_and_a_viewer_has_no_cancel(
    base: str, api: ApiClient, mosquitto: Mosquitto, browser: Browser
) -> None:
    script = Script(by_device={"hold-1": Behaviour.NO_ANSWER})
    async with answering(mosquitto, script):
        viewer, viewer_errors = await open_console(browser, base)
        await sign_in(viewer, VIEWER)
        await viewer.get_by_role("link", name="Campaigns").click()
        await expect(viewer.locator("#campaign-empty")).to_be_visible(timeout=WAIT_MS)
        operator, operator_errors = await open_console(browser, base)
        await sign_in(operator, OPERATOR)
        await operator.get_by_role("link", name="Campaigns").click()
        await expect(operator.locator("#campaign-empty")).to_be_visible(timeout=WAIT_MS)

        # Created after the pages opened: they learn of it, and of its progress, live.
        held = await start_campaign(api, "hold", ["hold-1"])
        done = await start_campaign(api, "reboot", ["pump-1", "pump-2", "pump-3"])
        row = campaign_row(viewer, done["id"])
        await expect(row.locator(".count-ACKED")).to_have_text("ACKED 3", timeout=WAIT_MS)
        await expect(row.locator(".count")).to_have_count(1)  # nothing else left
        await expect(row).to_contain_text("3 / 3 finished")
        await expect(row.locator(".status").first).to_have_text("COMPLETED", timeout=WAIT_MS)

        # The held campaign is RUNNING: the operator may cancel it, the viewer may not.
        held_for_viewer = campaign_row(viewer, held["id"])
        await expect(held_for_viewer.locator(".status").first).to_have_text("RUNNING")
        await expect(held_for_viewer.get_by_role("button")).to_have_count(0)
        held_for_operator = campaign_row(operator, held["id"])
        await expect(held_for_operator.locator(".status").first).to_have_text(
            "RUNNING", timeout=WAIT_MS
        )
        await expect(
            held_for_operator.get_by_role("button", name=f"Cancel campaign {held['id']}")
        ).to_be_visible()
        await expect(campaign_row(operator, done["id"]).get_by_role("button")).to_have_count(0)
        assert viewer_errors.errors == []
        assert operator_errors.errors == []


async def test_a_campaign_is_cancelled_from_the_page_by_keyboard(
    base: str, api: ApiClient, browser: Browser
) -> None:
    # No device answers: the commands stay open until the campaign is cancelled.
    page, errors = await open_console(browser, base, viewport=PHONE)
    await sign_in(page, OPERATOR)
    campaign = await start_campaign(api, "open-valve", ["quiet-1", "quiet-2"])
    await page.get_by_role("link", name="Campaigns").click()
    row = campaign_row(page, campaign["id"])
    await expect(row.locator(".status").first).to_have_text("RUNNING", timeout=WAIT_MS)
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], width
    cancel = row.get_by_role("button", name=f"Cancel campaign {campaign['id']}")
    await cancel.focus()
    await page.keyboard.press("Enter")
    await expect(row.locator(".status").first).to_have_text("CANCELLED", timeout=WAIT_MS)
    await expect(row.locator(".count-CANCELLED")).to_have_text("CANCELLED 2", timeout=WAIT_MS)
    await expect(row.get_by_role("button")).to_have_count(0)
    reply = await api.get(f"/campaigns/{campaign['id']}")
    assert (reply.body["status"], reply.body["counts"]["CANCELLED"]) == ("CANCELLED", 2)
    assert errors.errors == []


async def test_a_silence_created_on_the_page_is_the_tokens_and_is_expired_from_the_page(
    base: str, api: ApiClient, browser: Browser
) -> None:
    page, errors = await open_console(browser, base, viewport=PHONE)
    await sign_in(page, OPERATOR)
    await page.get_by_role("link", name="Notifications").click()
    form = page.locator("#silence-create")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#silence-empty")).to_be_visible(timeout=WAIT_MS)
    ends = (datetime.now() + timedelta(hours=2)).replace(second=0, microsecond=0)
    await form.get_by_label("Rules (comma-separated)").fill("door-open")
    await form.get_by_label("Devices (ids or globs)").fill("lab-*, door-1")
    await form.get_by_label("Severities").select_option(["MAJOR", "CRITICAL"])
    await form.get_by_label("Ends at").fill(ends.strftime("%Y-%m-%dT%H:%M"))
    await form.get_by_label("Comment").fill("lab maintenance")
    await form.get_by_role("button", name="Create silence").click()
    row = page.locator("#silence-table tbody tr").first
    await expect(row).to_contain_text("lab maintenance", timeout=WAIT_MS)
    await expect(row.locator(".active")).to_have_text("active")
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], width

    listed = (await api.get("/silences")).body["items"]
    assert len(listed) == 1
    silence = listed[0]
    assert silence["created_by"] == "olga"
    assert silence["matchers"] == {
        "rules": ["door-open"],
        "devices": ["lab-*", "door-1"],
        "severities": ["CRITICAL", "MAJOR"],
    }
    assert datetime.fromisoformat(silence["ends_at"]) == ends.astimezone()
    assert (silence["comment"], silence["active"]) == ("lab maintenance", True)

    await row.get_by_role("button", name=f"Expire silence {silence['id']}").click()
    await expect(row.locator(".active")).to_have_text("expired by olga", timeout=WAIT_MS)
    await expect(row.get_by_role("button")).to_have_count(0)
    ended = (await api.get("/silences")).body["items"][0]
    assert (ended["active"], ended["expired_by"]) == (False, "olga")
    assert errors.errors == []


async def test_a_viewer_reads_silences_without_changing_them(
    base: str, api: ApiClient, browser: Browser
) -> None:
    ends = (datetime.now().astimezone() + timedelta(hours=1)).isoformat()
    reply = await api.call(
        "POST", "/silences", token=OPERATOR, json={"ends_at": ends, "comment": "night"}
    )
    assert reply.status == 201, reply.body
    page, errors = await open_console(browser, base)
    await sign_in(page, VIEWER)
    await page.get_by_role("link", name="Notifications").click()
    row = page.locator("#silence-table tbody tr").first
    await expect(row).to_contain_text("night", timeout=WAIT_MS)
    await expect(row).to_contain_text("everything")
    await expect(row.get_by_role("button")).to_have_count(0)
    await expect(page.locator("#silence-create")).to_be_hidden()
    assert errors.errors == []


async def failed(api: ApiClient) -> bool:
    reply = await api.get("/deliveries?status=FAILED")
    return bool(reply.body["items"])


async def test_a_failed_delivery_is_listed_with_its_error(
    base: str, api: ApiClient, mosquitto: Mosquitto, browser: Browser
) -> None:
    # The page is open before the alarm: the delivery appears, and turns FAILED, by itself.
    page, errors = await open_console(browser, base)
    await sign_in(page, VIEWER)
    await page.get_by_role("link", name="Notifications").click()
    await expect(page.locator("#delivery-empty")).to_be_visible(timeout=WAIT_MS)
    body = {"ts": int(time.time() * 1000), "events": [{"type": "DOOR_OPEN"}]}
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        await client.publish(TOPICS.telemetry("door-9"), msgspec.json.encode(body), qos=1)
    await wait_until(lambda: failed(api), timeout=60, message="the delivery FAILED")
    delivery = (await api.get("/deliveries?status=FAILED")).body["items"][0]
    assert (delivery["receiver"], delivery["attempts"]) == ("nowhere", 1)
    assert delivery["last_error"]

    row = page.locator(f"#delivery-table tbody tr[data-delivery-id='{delivery['id']}']")
    # Read again every 10 s while nothing is open (3 s while something is): room for two reads.
    await expect(row).to_have_class("failed", timeout=2 * WAIT_MS)
    await expect(row).to_contain_text("alarm.created")
    await expect(row).to_contain_text("door-9")
    await expect(row).to_contain_text("nowhere")
    await expect(row.locator(".status")).to_have_text("FAILED")
    await expect(row.locator(".last-error")).to_have_text(delivery["last_error"])
    # The status filter: no delivery was sent; the failed one is found by its status.
    filters = page.locator("#delivery-filters")
    await filters.get_by_label("Status").select_option("SENT")
    await filters.get_by_role("button", name="Filter").click()
    await expect(page.locator("#delivery-empty")).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#delivery-table tbody tr")).to_have_count(0)
    await filters.get_by_label("Status").select_option("FAILED")
    await filters.get_by_role("button", name="Filter").click()
    await expect(row).to_be_visible(timeout=WAIT_MS)
    # The delivery links to its alarm: the alarm opens.
    alarm_id = delivery["alarm_id"]
    assert alarm_id is not None
    await row.get_by_role("link", name=f"alarm {alarm_id}").click()
    await expect(page).to_have_url(f"{base}/#/alarms/{alarm_id}")
    await expect(page.locator("#alarm-detail")).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#alarm-detail")).to_contain_text("door-9")
    assert errors.errors == []
