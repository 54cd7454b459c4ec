"""The console in a real browser against a real daemon, broker and PostgreSQL: signing in,
alarms arriving live from telemetry, the buttons, roles, the keyboard, the phone width, and
the stream coming back after the daemon restarts."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import aiomqtt
import asyncpg
import msgspec
from playwright.async_api import Browser, Locator, Page, Route, expect

from gateway.config import Config
from gateway.runtime.daemon import Daemon
from protocol import Topics
from storage.console import Cursor
from tests.support.api_client import ADMIN, OPERATOR, VIEWER
from tests.support.browser import (
    PHONE,
    WAIT_MS,
    PageErrors,
    Requests,
    open_console,
    require_chromium,
    sign_in,
)
from tests.support.daemon import make_config, running_daemon
from tests.support.fake_llm import FakeLlm
from tests.support.mosquitto import Mosquitto, events_subscriber
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
SECOND_OPERATOR = "second-operator-token-0123456789"
TOKENS = f"""
[[api.tokens]]
name = "wall-screen"
token = "{VIEWER}"
role = "viewer"

[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"

[[api.tokens]]
name = "ivan"
token = "{SECOND_OPERATOR}"
role = "operator"

[[api.tokens]]
name = "root"
token = "{ADMIN}"
role = "admin"
"""
RULES = """
[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
severity = "CRITICAL"
description = "Too hot: check the cooling."

[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
description = "A door opened."
"""


@dataclass
class Console:
    base: str
    daemon: Daemon
    mosquitto: Mosquitto


@contextlib.asynccontextmanager
async def console_daemon(
    db_dsn: str, mosquitto: Mosquitto, http_port: int
) -> AsyncIterator[Daemon]:
    config = make_config(
        dsn=db_dsn,
        mqtt_port=mosquitto.port,
        http_port=http_port,
        extra=TOKENS + RULES,
    )
    async with running_daemon(config) as daemon:
        yield daemon


async def publish(mosquitto: Mosquitto, device: str, payload: dict[str, object]) -> None:
    body = {"ts": int(time.time() * 1000), **payload}
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        await client.publish(TOPICS.telemetry(device), msgspec.json.encode(body), qos=1)


async def api(base: str, method: str, path: str, token: str, body: object = None) -> object:
    async with (
        aiohttp.ClientSession() as http,
        http.request(
            method, f"{base}{path}", json=body, headers={"Authorization": f"Bearer {token}"}
        ) as reply,
    ):
        assert reply.status < 300, (reply.status, await reply.text())
        return await reply.json()


def alarm_row(page: Page, device: str) -> Locator:
    return page.locator("#alarm-table tbody tr", has_text=device)


async def open_alarm(page: Page, device: str) -> Locator:
    """Wait for the device's alarm in the list and open its detail; its row."""
    row = alarm_row(page, device)
    await expect(row).to_be_visible(timeout=WAIT_MS)
    await row.get_by_role("link", name="#").first.click()
    return row


async def test_a_bad_token_is_refused_with_a_clear_message(
    console: Console, browser: Browser
) -> None:
    page, errors = await open_console(browser, console.base)
    await page.get_by_label("API token").fill("not-a-token-of-this-gateway")
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#sign-in-error")).to_contain_text("refused", timeout=WAIT_MS)
    await expect(page.locator("#nav")).to_be_hidden()
    assert await page.evaluate("sessionStorage.getItem('gateway.token')") is None
    # The right one then works, and is kept for this tab only.
    await sign_in(page, OPERATOR)
    await expect(page.locator("#who")).to_have_text("olga (operator)")
    assert await page.evaluate("sessionStorage.getItem('gateway.token')") == OPERATOR
    await page.reload()
    await expect(page.locator("#who")).to_have_text("olga (operator)", timeout=WAIT_MS)
    await page.get_by_role("button", name="Sign out").click()
    await expect(page.locator("#sign-in")).to_be_visible()
    assert await page.evaluate("sessionStorage.getItem('gateway.token')") is None
    assert errors.errors == []


async def test_an_alarm_from_telemetry_appears_live_and_is_handled_through_the_buttons(
    console: Console, browser: Browser
) -> None:
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    await expect(page.locator("#alarm-empty")).to_be_visible(timeout=WAIT_MS)
    # A mark that a reload would wipe: the alarm must come without one.
    await page.evaluate("window.__not_reloaded = true")
    await publish(console.mosquitto, "boiler-1", {"metrics": {"temp": 93.5}})
    row = alarm_row(page, "boiler-1")
    await expect(row).to_be_visible(timeout=WAIT_MS)
    await expect(row).to_contain_text("CRITICAL")
    await expect(row).to_contain_text("temp-high")
    assert await page.evaluate("window.__not_reloaded") is True

    await row.get_by_role("link", name="#").first.click()
    detail = page.locator("#alarm-detail")
    await expect(detail.locator(".trigger")).to_contain_text("temp = 93.5", timeout=WAIT_MS)
    await expect(detail.locator(".trigger")).to_contain_text("temp > 80")
    await expect(detail.locator(".rule-description")).to_have_text("Too hot: check the cooling.")
    for label, status in (
        ("Confirm", "CONFIRMED"),
        ("Mark handled", "HANDLED"),
        ("Close", "CLOSED"),
    ):
        await detail.get_by_role("button", name=label).click()
        await expect(detail.locator("#alarm-status")).to_have_text(status, timeout=WAIT_MS)
    audit = detail.locator("ol.audit li")
    for action in ("confirm", "handle", "close"):
        await expect(audit.filter(has_text=f"olga {action}")).to_have_count(1)
    # Closed: no button is left to press.
    await expect(detail.locator(".actions button")).to_have_count(0)
    assert errors.errors == []


async def test_an_alarm_from_an_older_release_says_when_not_why(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """An alarm raised before alarms kept their reason has, since migration 0036, only its
    sample's time as its trigger: the detail says so in words, not as JSON."""
    await publish(console.mosquitto, "cellar-door", {"events": [{"type": "DOOR_OPEN"}]})

    async def raised() -> bool:
        return bool(await db.fetchval("SELECT count(*) FROM alarm WHERE device_id = 'cellar-door'"))

    await wait_until(raised, timeout=60, interval=0.05, message="the alarm")
    # What the migration leaves on such an alarm (its to_char format).
    await db.execute(
        "UPDATE alarm SET trigger = jsonb_build_object('sample_ts', "
        "'2025-03-01T12:00:00.000000+00:00') WHERE device_id = 'cellar-door'"
    )
    page, errors = await open_console(browser, console.base)
    await sign_in(page, VIEWER)
    await open_alarm(page, "cellar-door")
    why = page.locator("#alarm-detail .trigger")
    await expect(why).to_contain_text("no reason kept", timeout=WAIT_MS)
    await expect(why).to_contain_text("2025-03-01")
    await expect(why).not_to_contain_text("{")
    assert errors.errors == []


async def test_a_viewer_sees_no_action_buttons(console: Console, browser: Browser) -> None:
    await publish(console.mosquitto, "door-9", {"events": [{"type": "DOOR_OPEN"}]})
    page, errors = await open_console(browser, console.base)
    await sign_in(page, VIEWER)
    await open_alarm(page, "door-9")
    detail = page.locator("#alarm-detail")
    await expect(detail.locator("ol.audit li").first).to_be_visible(timeout=WAIT_MS)
    await expect(detail.locator("button")).to_have_count(0)
    # The same alarm offers the buttons to an operator: the viewer's page hid them.
    actions = await api(
        console.base,
        "GET",
        f"/alarms/{await detail.get_attribute('data-alarm-id')}/actions",
        VIEWER,
    )
    assert actions["actions"]  # type: ignore[index]  # JSON
    await page.goto(f"{console.base}/#/commands/door-9")
    await expect(page.locator("#command-create")).to_be_hidden()
    await expect(page.locator("#nav-dead-letters")).to_be_hidden()
    assert errors.errors == []


async def test_a_stale_button_says_who_acted_first(console: Console, browser: Browser) -> None:
    await publish(console.mosquitto, "door-2", {"events": [{"type": "DOOR_OPEN"}]})
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    row = alarm_row(page, "door-2")
    await expect(row).to_be_visible(timeout=WAIT_MS)
    alarm_id = await row.get_attribute("data-alarm-id")
    await page.goto(f"{console.base}/#/alarms/{alarm_id}")
    detail = page.locator("#alarm-detail")
    confirm = detail.get_by_role("button", name="Confirm")
    await expect(confirm).to_be_visible(timeout=WAIT_MS)
    # The page may not redraw before its operator presses the button: its reads of the
    # alarm are held (the audit, the action itself and the stream pass) until released.
    released = asyncio.Event()

    async def hold_reads(route: Route) -> None:
        request = route.request
        if request.method == "GET" and not request.url.endswith("/audit"):
            await released.wait()
        await route.continue_()

    await page.route("**/alarms**", hold_reads)
    await api(console.base, "POST", f"/alarms/{alarm_id}/confirm", SECOND_OPERATOR, {})
    async with page.expect_response(lambda r: r.request.method == "POST") as answer:
        await confirm.click()
    # The race's loser gets a 409 naming the winner, and the page says it in words.
    assert (await answer.value).status == 409
    await expect(page.locator("#notice")).to_have_text(
        "ivan already did this (the alarm is CONFIRMED).", timeout=WAIT_MS
    )
    released.set()
    await expect(detail.locator("#alarm-status")).to_have_text("CONFIRMED", timeout=WAIT_MS)
    await expect(detail.locator("ol.audit li").filter(has_text="ivan confirm")).to_have_count(1)
    # Nothing olga did is in the trail: no entry's actor is she. (Her name may be in a note: the
    # stream that showed her the alarm is named in its "push" entry when it reached her first.)
    actors = detail.locator("ol.audit li strong.actor")
    await expect(actors.filter(has_text=re.compile(r"^ivan$"))).to_have_count(1)
    await expect(actors.filter(has_text=re.compile(r"^olga$"))).to_have_count(0)
    assert errors.errors == []


async def test_a_button_made_stale_by_another_step_says_who_acted(
    console: Console, browser: Browser
) -> None:
    await publish(console.mosquitto, "door-3", {"events": [{"type": "DOOR_OPEN"}]})
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    row = alarm_row(page, "door-3")
    await expect(row).to_be_visible(timeout=WAIT_MS)
    alarm_id = await row.get_attribute("data-alarm-id")
    await api(console.base, "POST", f"/alarms/{alarm_id}/confirm", OPERATOR, {})
    await page.goto(f"{console.base}/#/alarms/{alarm_id}")
    detail = page.locator("#alarm-detail")
    handle = detail.get_by_role("button", name="Mark handled")
    await expect(handle).to_be_visible(timeout=WAIT_MS)
    released = asyncio.Event()

    async def hold_reads(route: Route) -> None:
        if route.request.method == "GET" and not route.request.url.endswith("/audit"):
            await released.wait()
        await route.continue_()

    await page.route("**/alarms**", hold_reads)
    # Ivan calls it a false alarm meanwhile: "handle" is no step from FALSE (a 400, not a
    # lost race on the same step).
    await api(console.base, "POST", f"/alarms/{alarm_id}/false", SECOND_OPERATOR, {})
    async with page.expect_response(lambda r: r.request.method == "POST") as answer:
        await handle.click()
    assert (await answer.value).status == 400
    await expect(page.locator("#notice")).to_have_text(
        "ivan acted first (false): the alarm is now FALSE.", timeout=WAIT_MS
    )
    released.set()
    await expect(detail.locator("#alarm-status")).to_have_text("FALSE", timeout=WAIT_MS)
    await expect(detail.locator(".actions button")).to_have_count(0)
    assert errors.errors == []


async def test_keyboard_alone_signs_in_opens_an_alarm_and_confirms_it(
    console: Console, browser: Browser
) -> None:
    await publish(console.mosquitto, "kbd-1", {"metrics": {"temp": 88}})
    page, errors = await open_console(browser, console.base)
    # The page puts the focus in the token field.
    await expect(page.get_by_label("API token")).to_be_focused(timeout=WAIT_MS)
    await page.keyboard.type(OPERATOR)
    await page.keyboard.press("Enter")
    await expect(alarm_row(page, "kbd-1")).to_be_visible(timeout=WAIT_MS)

    async def tab_to(selector: str) -> None:
        for _ in range(80):
            if await page.evaluate(f"document.activeElement.matches({selector!r})"):
                return
            await page.keyboard.press("Tab")
        raise AssertionError(f"{selector} not reachable with Tab")

    await tab_to("#alarm-table a[href^='#/alarms/']")
    await page.keyboard.press("Enter")
    await expect(page.locator("#alarm-detail h3").first).to_be_focused(timeout=WAIT_MS)
    await tab_to("#alarm-detail button[data-action='confirm']")
    # The focused control is visibly marked.
    outline = await page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none"
    await page.keyboard.press("Enter")
    await expect(page.locator("#alarm-status")).to_have_text("CONFIRMED", timeout=WAIT_MS)
    assert errors.errors == []


async def test_the_alarm_list_and_detail_fit_a_phone(console: Console, browser: Browser) -> None:
    await publish(console.mosquitto, "phone-1", {"metrics": {"temp": 99}})
    page, errors = await open_console(browser, console.base, viewport=PHONE)
    await sign_in(page, OPERATOR)
    await open_alarm(page, "phone-1")
    confirm = page.locator("#alarm-detail").get_by_role("button", name="Confirm")
    await expect(confirm).to_be_visible(timeout=WAIT_MS)
    # Nothing is wider than the screen: no sideways scrolling to reach a button.
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], width
    box = await confirm.bounding_box()
    assert box is not None
    assert box["x"] + box["width"] <= PHONE["width"]
    await confirm.click()
    await expect(page.locator("#alarm-status")).to_have_text("CONFIRMED", timeout=WAIT_MS)
    assert errors.errors == []


async def test_the_stream_resumes_after_the_daemon_restarts(
    db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    require_chromium()
    port = free_port()
    async with console_daemon(db_dsn, mosquitto, port):
        page, errors = await open_console(browser, f"http://127.0.0.1:{port}")
        await sign_in(page, OPERATOR)
        await publish(mosquitto, "before-1", {"metrics": {"temp": 91}})
        await expect(alarm_row(page, "before-1")).to_be_visible(timeout=WAIT_MS)
    # The daemon is gone: the page says so, and keeps trying.
    await expect(page.locator("#live")).to_have_text("reconnecting…", timeout=WAIT_MS)
    await page.evaluate("window.__not_reloaded = true")
    async with console_daemon(db_dsn, mosquitto, port):
        await expect(page.locator("#live")).to_have_text("live", timeout=WAIT_MS)
        await publish(mosquitto, "after-1", {"metrics": {"temp": 92}})
        await expect(alarm_row(page, "after-1")).to_be_visible(timeout=WAIT_MS)
        assert await page.evaluate("window.__not_reloaded") is True
        await expect(alarm_row(page, "before-1")).to_have_count(1)
    assert errors.errors == []


async def test_a_page_on_one_node_sees_what_happens_through_another(
    db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    require_chromium()
    port_a, port_b = free_port(), free_port()

    def config(node: str, port: int) -> Config:
        return make_config(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            http_port=port,
            node_id=node,
            extra=TOKENS + RULES,
            mqtt_extra='shared_group = "console"',
        )

    async with (
        events_subscriber(mosquitto.port),  # a person's app: the alarms are pushed
        running_daemon(config("node-a", port_a)),
        running_daemon(config("node-b", port_b)),
    ):
        page, errors = await open_console(browser, f"http://127.0.0.1:{port_a}")
        await sign_in(page, OPERATOR)
        # Telemetry goes to whichever node the broker picks; the alarm shows on A's page.
        for n in range(4):
            await publish(mosquitto, f"shared-{n}", {"metrics": {"temp": 90 + n}})
        for n in range(4):
            await expect(alarm_row(page, f"shared-{n}")).to_be_visible(timeout=WAIT_MS)
        row = alarm_row(page, "shared-0")
        alarm_id = await row.get_attribute("data-alarm-id")
        await row.get_by_role("link", name="#").first.click()
        status = page.locator("#alarm-detail #alarm-status")
        await expect(status).to_have_text("PUSHED", timeout=WAIT_MS)
        # Ivan confirms through node B's API: A's page shows it, live.
        await api(
            f"http://127.0.0.1:{port_b}", "POST", f"/alarms/{alarm_id}/confirm", SECOND_OPERATOR, {}
        )
        await expect(status).to_have_text("CONFIRMED", timeout=WAIT_MS)
        await expect(
            page.locator("#alarm-detail ol.audit li").filter(has_text="ivan confirm")
        ).to_have_count(1)
        assert errors.errors == []


async def test_an_alarms_ai_summary_shows_in_its_detail(
    db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    require_chromium()
    port = free_port()
    async with FakeLlm() as llm:
        ai = f'[ai]\nenabled = true\nbase_url = "{llm.base_url}"\nmodel = "fake-model"\n'
        config = make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=ai + TOKENS + RULES
        )
        async with running_daemon(config):
            page, errors = await open_console(browser, f"http://127.0.0.1:{port}")
            await sign_in(page, VIEWER)
            await publish(mosquitto, "hall-door", {"events": [{"type": "DOOR_OPEN"}]})
            row = await open_alarm(page, "hall-door")
            alarm_id = await row.get_attribute("data-alarm-id")
            base = f"http://127.0.0.1:{port}"

            async def summarised() -> bool:
                alarm = await api(base, "GET", f"/alarms/{alarm_id}", VIEWER)
                return (alarm.get("ai_summary") or {}).get("status") == "SUCCEEDED"  # type: ignore[attr-defined]  # JSON

            # The worker's pace is not the page's: wait for the summary itself (a loaded
            # machine may take a while), then the open detail must show it.
            await wait_until(summarised, timeout=90, interval=0.2, message="the AI summary")
            summary = page.locator("#alarm-detail dl.summary")
            await expect(summary).to_contain_text("Door open at the hall", timeout=WAIT_MS)
            await expect(summary).to_contain_text("Check the hall door")
            await expect(summary).to_contain_text("MEDIUM")
            assert errors.errors == []


async def _stream_past_every_event(console: Console, db: asyncpg.Connection) -> None:
    """The node's stream hub has passed every event written so far: a stream opened now
    starts after them. (Events reach streams once final, when every older transaction on the
    server has ended: a transaction of another test running beside this one holds them back,
    and a page opened before then would still be written their creation, and push them.)"""
    newest = await db.fetchrow("SELECT xid::text AS xid, id FROM outbox_event ORDER BY id DESC")
    assert newest is not None
    last = Cursor(int(newest["xid"]), newest["id"])
    hub = console.daemon.services.stream_hub
    assert hub is not None
    await wait_until(
        lambda: hub.head is not None and hub.head >= last,
        timeout=90,
        message="the stream past the events",
    )


async def test_alarms_come_most_severe_first_and_every_filter_narrows_them(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    async def raised(count: int) -> None:
        async def listed() -> bool:
            alarms = await api(console.base, "GET", "/alarms", VIEWER)
            return len(alarms["items"]) == count  # type: ignore[index]  # JSON

        await wait_until(listed, message=f"{count} alarms raised")

    # One after another: messages of different devices may commit in either order (two
    # transactions in flight), and "newest" is the order they were raised in. Raised before the
    # page opens: its stream, starting from now, never writes their creation, which would push
    # them (an open console reaches a person); the last filter wants them NEW. So the page
    # opens once the node's stream is past them.
    await publish(console.mosquitto, "door-2", {"events": [{"type": "DOOR_OPEN"}]})  # MAJOR
    await raised(1)
    await publish(console.mosquitto, "boiler-3", {"metrics": {"temp": 91}})  # CRITICAL
    await raised(2)
    await publish(console.mosquitto, "door-4", {"events": [{"type": "DOOR_OPEN"}]})  # MAJOR
    await raised(3)
    await _stream_past_every_event(console, db)
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    rows = page.locator("#alarm-table tbody tr")
    await expect(rows).to_have_count(3, timeout=WAIT_MS)
    # The CRITICAL one first although it is not the newest; then the MAJOR ones, newest first.
    await expect(rows.nth(0)).to_contain_text("boiler-3")
    await expect(rows.nth(1)).to_contain_text("door-4")
    await expect(rows.nth(2)).to_contain_text("door-2")
    filters = page.locator("#alarm-filters")

    async def apply(
        *, status: str = "open", severity: str = "", device: str = "", rule: str = ""
    ) -> None:
        await filters.get_by_label("Status").select_option(status)
        await filters.get_by_label("Severity").select_option(severity)
        await filters.get_by_label("Device").fill(device)
        await filters.get_by_label("Rule").fill(rule)
        await filters.get_by_role("button", name="Filter").click()
        # The list as it was has as many rows as some filters' answers: wait for the answer.
        await expect(page.locator("#alarm-list")).to_have_attribute(
            "aria-busy", "false", timeout=WAIT_MS
        )

    async def shown(*devices: str) -> None:
        await expect(rows).to_have_count(len(devices), timeout=WAIT_MS)
        for n, device in enumerate(devices):
            await expect(rows.nth(n)).to_contain_text(device)

    await apply(severity="MAJOR")
    await shown("door-4", "door-2")
    await apply(device="door-2")
    await shown("door-2")
    await apply(rule="temp-high")
    await shown("boiler-3")
    # Confirm one; the status filter then finds it alone.
    await apply(device="door-4")
    await shown("door-4")
    await rows.first.get_by_role("link", name="#").first.click()
    detail = page.locator("#alarm-detail")
    await detail.get_by_role("button", name="Confirm").click()
    await expect(detail.locator("#alarm-status")).to_have_text("CONFIRMED", timeout=WAIT_MS)
    await apply(status="CONFIRMED")
    await shown("door-4")
    # Nothing reached a person (no subscriber to the events, no receiver, no console open when
    # they were made): the others are NEW.
    await apply(status="NEW")
    await shown("boiler-3", "door-2")
    assert errors.errors == []


async def _two_devices_alarmed(console: Console, db: asyncpg.Connection) -> None:
    """door-2 (MAJOR) and boiler-3 (CRITICAL) alarmed, and the node's stream past them."""

    async def raised(count: int) -> None:
        async def listed() -> bool:
            alarms = await api(console.base, "GET", "/alarms", VIEWER)
            return len(alarms["items"]) == count  # type: ignore[index]  # JSON

        await wait_until(listed, message=f"{count} alarms raised")

    await publish(console.mosquitto, "door-2", {"events": [{"type": "DOOR_OPEN"}]})
    await raised(1)
    await publish(console.mosquitto, "boiler-3", {"metrics": {"temp": 91}})
    await raised(2)
    await _stream_past_every_event(console, db)


class _Held:
    """A route handler that holds the first request it matches (its answer on its way) until
    ``release``; later ones pass."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.released = asyncio.Event()

    async def __call__(self, route: Route) -> None:
        if not self.held.is_set():
            self.held.set()
            await self.released.wait()
        await route.continue_()

    async def taken(self) -> None:
        await asyncio.wait_for(self.held.wait(), timeout=WAIT_MS / 1000)

    def release(self) -> None:
        self.released.set()


async def _two_alarms_open(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> tuple[Page, PageErrors, dict[str, int]]:
    """door-2's and boiler-3's alarms listed on an operator's page; their ids by device."""
    await _two_devices_alarmed(console, db)
    alarms = await api(console.base, "GET", "/alarms", VIEWER)
    ids = {a["device_id"]: a["id"] for a in alarms["items"]}  # type: ignore[index]  # JSON
    page, errors = await open_console(browser, console.base)
    await sign_in(page, OPERATOR)
    await expect(page.locator("#alarm-table tbody tr")).to_have_count(2, timeout=WAIT_MS)
    return page, errors, ids


async def _readings_dropped(page: Page) -> int:
    return int(await page.evaluate("window.__readingsDropped || 0"))


async def _first_answer_handled(
    page: Page, detail: Locator, attribute: str, shown: str, dropped: int
) -> None:
    """The held first answer has come and been dropped, or (the fault) painted over ``shown``."""

    async def handled() -> bool:
        if await _readings_dropped(page) > dropped:
            return True
        return await detail.get_attribute(attribute) != shown

    await wait_until(handled, message="the first answer handled")


async def _an_overtaken_answer_is_dropped(
    page: Page, *, path: str, form: str, field: str, table: str
) -> None:
    """The list at ``path`` filtered by ``field`` of ``form``: first door-2, then boiler-3
    before the first answer came. The list shows boiler-3; the first answer, when it comes, is
    dropped (the page counts it), never painted over the filters the form now holds."""
    rows = page.locator(f"{table} tbody tr")
    filters = page.locator(form)
    first = _Held()
    await page.route(lambda url: f"{path}?" in url and "door-2" in url, first)
    try:
        await filters.get_by_label(field).fill("door-2")
        await filters.get_by_role("button", name="Filter").click()
        await first.taken()
        await filters.get_by_label(field).fill("boiler-3")
        await filters.get_by_role("button", name="Filter").click()
        await expect(rows).to_have_count(1, timeout=WAIT_MS)
        await expect(rows.first).to_contain_text("boiler-3")
        dropped = await _readings_dropped(page)
    finally:
        first.release()

    async def answered() -> bool:  # dropped, or (the fault) painted
        painted = await rows.filter(has_text="door-2").count() > 0
        return painted or await _readings_dropped(page) > dropped

    await wait_until(answered, message="the first filter's answer handled")
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_contain_text("boiler-3")
    assert await _readings_dropped(page) == dropped + 1


async def test_an_answer_to_filters_no_longer_asked_is_never_shown(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """An operator filters a list by one device, then by another before the first answer came
    (a slow network, a loaded node): the alarm list, then the device list."""
    page, errors, _ = await _two_alarms_open(console, browser, db)
    await _an_overtaken_answer_is_dropped(
        page, path="/alarms", form="#alarm-filters", field="Device", table="#alarm-table"
    )
    # The alarm list is busy until its newest reading is shown: it is.
    await expect(page.locator("#alarm-list")).to_have_attribute("aria-busy", "false")
    await page.goto(f"{console.base}/#/devices")
    await expect(page.locator("#device-table tbody tr")).to_have_count(2, timeout=WAIT_MS)
    await _an_overtaken_answer_is_dropped(
        page, path="/devices", form="#device-filters", field="Selector", table="#device-table"
    )
    assert errors.errors == []


async def test_a_live_update_answering_for_a_filter_still_orders_the_list_afresh(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """An alarm open (the list holds still for live updates), the operator filters by a device;
    a live update overtakes that reading and answers first: the list shows the filter's alarms
    (what Filter asked for), not the rows it held with the filtered-out ones dimmed; the
    overtaken answer, when it comes, is dropped."""
    page, errors, _ = await _two_alarms_open(console, browser, db)
    rows = page.locator("#alarm-table tbody tr")
    await rows.filter(has_text="door-2").get_by_role("link", name="#").first.click()
    await expect(page.locator("#alarm-detail")).to_contain_text("door-2", timeout=WAIT_MS)
    filters = page.locator("#alarm-filters")
    first = _Held()
    await page.route(lambda url: "/alarms?" in url and "boiler-3" in url, first)
    try:
        await filters.get_by_label("Device").fill("boiler-3")
        await filters.get_by_role("button", name="Filter").click()
        await first.taken()
        dropped = await _readings_dropped(page)
        # A new alarm elsewhere: its event reaches the page, which reads the list again.
        await publish(console.mosquitto, "door-5", {"events": [{"type": "DOOR_OPEN"}]})
        await expect(rows).to_have_count(1, timeout=WAIT_MS)
        await expect(rows.first).to_contain_text("boiler-3")
        await expect(page.locator("#alarm-list")).to_have_attribute("aria-busy", "false")
    finally:
        first.release()

    async def dropped_now() -> bool:
        return await _readings_dropped(page) > dropped

    await wait_until(dropped_now, message="the overtaken answer dropped")
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_contain_text("boiler-3")
    assert errors.errors == []


async def test_the_detail_shows_the_alarm_opened_last_and_its_buttons_act_on_it(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """The operator opens one alarm, then another before the first one's answer came: the
    detail shows the second; the first answer, when it comes, is dropped, so Confirm confirms
    the alarm the operator sees, never the one opened before."""
    page, errors, ids = await _two_alarms_open(console, browser, db)
    rows = page.locator("#alarm-table tbody tr")
    detail = page.locator("#alarm-detail")
    first = _Held()
    await page.route(lambda url: url.endswith(f"/alarms/{ids['door-2']}"), first)
    try:
        await rows.filter(has_text="door-2").get_by_role("link", name="#").first.click()
        await first.taken()
        await rows.filter(has_text="boiler-3").get_by_role("link", name="#").first.click()
        await expect(detail).to_have_attribute(
            "data-alarm-id", str(ids["boiler-3"]), timeout=WAIT_MS
        )
        dropped = await _readings_dropped(page)
    finally:
        first.release()
    await _first_answer_handled(page, detail, "data-alarm-id", str(ids["boiler-3"]), dropped)
    await expect(detail).to_have_attribute("data-alarm-id", str(ids["boiler-3"]))
    await expect(detail).to_contain_text("boiler-3")
    await detail.get_by_role("button", name="Confirm").click()
    await expect(detail.locator("#alarm-status")).to_have_text("CONFIRMED", timeout=WAIT_MS)
    boiler = await api(console.base, "GET", f"/alarms/{ids['boiler-3']}", VIEWER)
    door = await api(console.base, "GET", f"/alarms/{ids['door-2']}", VIEWER)
    assert (boiler["status"], door["status"]) == ("CONFIRMED", "NEW")  # type: ignore[index]  # JSON
    assert errors.errors == []


async def test_a_change_to_the_alarm_being_opened_is_followed_before_its_first_answer(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """One alarm shown, the operator opens another; before its answer comes, someone else
    confirms that other one: the detail follows the alarm being opened (it is the selection
    from the click on), so the change is drawn without waiting for the first answer, which is
    dropped when it comes."""
    page, errors, ids = await _two_alarms_open(console, browser, db)
    rows = page.locator("#alarm-table tbody tr")
    detail = page.locator("#alarm-detail")
    await rows.filter(has_text="door-2").get_by_role("link", name="#").first.click()
    await expect(detail).to_have_attribute("data-alarm-id", str(ids["door-2"]), timeout=WAIT_MS)
    first = _Held()
    await page.route(lambda url: url.endswith(f"/alarms/{ids['boiler-3']}"), first)
    try:
        await rows.filter(has_text="boiler-3").get_by_role("link", name="#").first.click()
        await first.taken()
        dropped = await _readings_dropped(page)
        await api(console.base, "POST", f"/alarms/{ids['boiler-3']}/confirm", ADMIN, {})
        await expect(detail).to_have_attribute(
            "data-alarm-id", str(ids["boiler-3"]), timeout=WAIT_MS
        )
        await expect(detail.locator("#alarm-status")).to_have_text("CONFIRMED")
    finally:
        first.release()

    async def dropped_now() -> bool:
        return await _readings_dropped(page) > dropped

    await wait_until(dropped_now, message="the first answer dropped")
    await expect(detail).to_have_attribute("data-alarm-id", str(ids["boiler-3"]))
    await expect(detail.locator("#alarm-status")).to_have_text("CONFIRMED")
    assert errors.errors == []


async def test_an_alarm_that_cannot_be_read_closes_the_detail_of_the_one_before(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """One alarm shown, the operator opens another whose reading fails: the detail closes (the
    first alarm's buttons never stay under the second's selection) and the failure is said."""
    page, errors, ids = await _two_alarms_open(console, browser, db)
    rows = page.locator("#alarm-table tbody tr")
    detail = page.locator("#alarm-detail")
    await rows.filter(has_text="door-2").get_by_role("link", name="#").first.click()
    await expect(detail).to_have_attribute("data-alarm-id", str(ids["door-2"]), timeout=WAIT_MS)

    async def unavailable(route: Route) -> None:
        await route.fulfill(status=503, json={"code": "UNAVAILABLE", "detail": "try again"})

    await page.route(lambda url: url.endswith(f"/alarms/{ids['boiler-3']}"), unavailable)
    await rows.filter(has_text="boiler-3").get_by_role("link", name="#").first.click()
    await expect(detail).to_be_hidden(timeout=WAIT_MS)
    await expect(detail.get_by_role("button", name="Confirm")).to_have_count(0)
    await expect(page.locator("#alarm-table tbody tr.selected")).to_have_count(0)
    assert errors.errors == []


async def test_the_device_page_shows_the_device_opened_last(
    console: Console, browser: Browser, db: asyncpg.Connection
) -> None:
    """The same for a device's page (its commands form acts on the device shown)."""
    page, errors, _ = await _two_alarms_open(console, browser, db)
    await page.goto(f"{console.base}/#/devices")
    rows = page.locator("#device-table tbody tr")
    await expect(rows).to_have_count(2, timeout=WAIT_MS)
    detail = page.locator("#device-detail")
    first = _Held()
    await page.route(lambda url: url.endswith("/device?id=door-2"), first)
    try:
        await rows.get_by_role("link", name="door-2").click()
        await first.taken()
        await rows.get_by_role("link", name="boiler-3").click()
        await expect(detail).to_have_attribute("data-device-id", "boiler-3", timeout=WAIT_MS)
        dropped = await _readings_dropped(page)
    finally:
        first.release()
    await _first_answer_handled(page, detail, "data-device-id", "boiler-3", dropped)
    await expect(detail).to_have_attribute("data-device-id", "boiler-3")
    await expect(detail.locator("h3").first).to_have_text("boiler-3")
    assert errors.errors == []


# What the keyboard must reach: every visible control of a section.
_CONTROLS = "a[href], button, input, select, textarea, [tabindex]:not([tabindex='-1'])"


async def test_every_control_of_every_section_is_reachable_with_tab(
    console: Console, browser: Browser
) -> None:
    """As an admin (who sees every section and every form), for each section: Tab from the top
    of the page reaches each visible, enabled control, and the focus is always visible."""
    await publish(console.mosquitto, "tab-1", {"metrics": {"temp": 90}})
    page, errors = await open_console(browser, console.base)
    requests = Requests(page)
    await sign_in(page, ADMIN)
    await expect(alarm_row(page, "tab-1")).to_be_visible(timeout=WAIT_MS)
    await alarm_row(page, "tab-1").get_by_role("link", name="#").first.click()
    await expect(page.locator("#alarm-detail .actions button").first).to_be_visible(timeout=WAIT_MS)
    for section in ("alarms", "devices", "commands/tab-1", "campaigns", "notifications",
                    "figures", "dead-letters"):  # fmt: skip
        if section != "alarms":
            await page.goto(f"{console.base}/#/{section}")
        view = page.locator(f"#view-{section.split('/')[0]}")
        await expect(view).to_be_visible(timeout=WAIT_MS)
        await requests.settled()
        wanted = await page.evaluate(
            """selector => {
                let n = 0;
                for (const e of document.querySelectorAll(selector)) {
                    const shown = e.offsetParent !== null
                        && getComputedStyle(e).visibility !== 'hidden' && !e.closest('[hidden]');
                    if (shown && !e.disabled) e.dataset.kb = String(n++);
                    else delete e.dataset.kb;
                }
                return n;
            }""",
            _CONTROLS,
        )
        assert wanted > 0, section
        await page.evaluate("document.activeElement && document.activeElement.blur()")
        reached: set[str] = set()
        for _ in range(wanted * 3 + 20):
            await page.keyboard.press("Tab")
            focus = await page.evaluate(
                """() => {
                    const e = document.activeElement;
                    if (!e || e === document.body) return null;
                    const style = getComputedStyle(e);
                    const marked = style.outlineStyle !== 'none' || style.boxShadow !== 'none';
                    return [e.dataset.kb ?? null, marked];
                }"""
            )
            if focus is None or focus[0] is None:
                continue
            key, marked = focus
            assert marked, (
                section,
                await page.evaluate(
                    "[document.activeElement.outerHTML.slice(0, 200),"
                    " document.activeElement.matches(':focus'),"
                    " getComputedStyle(document.activeElement).outlineStyle,"
                    " getComputedStyle(document.activeElement).outlineWidth]"
                ),
            )
            reached.add(key)
            if len(reached) == wanted:
                break
        missing = await page.evaluate(
            "keys => [...document.querySelectorAll('[data-kb]')]"
            ".filter(e => !keys.includes(e.dataset.kb)).map(e => e.outerHTML.slice(0, 120))",
            sorted(reached),
        )
        assert missing == [], (section, missing)
    assert errors.errors == []
