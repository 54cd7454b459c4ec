"""A token removed by a configuration reload (SIGHUP) while a console page is open on a
section that reads its list again by itself (Commands with an open command, every 2 s;
Notifications, every 3 or 10 s): the page must go to the sign-in with a clear word, say
nothing else, throw nothing, and stop asking. A real daemon, PostgreSQL and chromium."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from playwright.async_api import Browser, Request, expect

from gateway.runtime.daemon import Daemon
from tests.support.api_client import ADMIN, OPERATOR
from tests.support.browser import WAIT_MS, open_console, require_chromium, sign_in
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

OLGA = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"
"""
ROOT = f"""
[[api.tokens]]
name = "root"
token = "{ADMIN}"
role = "admin"
"""


@pytest.fixture
async def rig(db_dsn: str, mosquitto: Mosquitto) -> AsyncIterator[tuple[str, Daemon, int]]:
    require_chromium()
    port = free_port()
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=OLGA + ROOT)
    async with running_daemon(config) as daemon:
        yield f"http://127.0.0.1:{port}", daemon, port


def revoke_olga(daemon: Daemon, dsn: str, mqtt_port: int, http_port: int) -> None:
    daemon.reload(make_config(dsn=dsn, mqtt_port=mqtt_port, http_port=http_port, extra=ROOT))


@pytest.mark.parametrize("section", ["commands", "notifications"])
async def test_a_token_removed_by_a_reload_signs_the_page_out_cleanly(
    rig: tuple[str, Daemon, int],
    db_dsn: str,
    mosquitto: Mosquitto,
    browser: Browser,
    section: str,
) -> None:
    base, daemon, port = rig
    # An open command (nobody answers it): the commands view reads its list every 2 s.
    async with (
        aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {OPERATOR}"}) as http,
        http.post("/devices/quiet-1/commands", json={"name": "open-valve"}) as reply,
    ):
        assert reply.status == 201, await reply.text()
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.goto(f"{base}/#/{section}")
    table = "#command-table" if section == "commands" else "#delivery-table"
    await expect(page.locator(table)).to_be_visible(timeout=WAIT_MS)
    if section == "commands":
        await expect(page.locator(f"{table} tbody tr")).to_have_count(1, timeout=WAIT_MS)

    asked: list[float] = []

    def note(request: Request) -> None:
        if "/stream" not in request.url and "/console" not in request.url:
            asked.append(time.monotonic())

    page.on("request", note)
    revoke_olga(daemon, db_dsn, mosquitto.port, port)
    await expect(page.locator("#sign-in")).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#sign-in-error")).to_contain_text("no longer accepts this token")
    # The sign-in says it all: no leftover notice of a view beside it.
    await expect(page.locator("#notice")).to_be_hidden()
    # Signed out: past the views' next reads (2 s, 3 s, 10 s), nothing is asked any more.
    signed_out = time.monotonic()
    await wait_until(
        lambda: time.monotonic() - signed_out > 11, timeout=15, message="the views' next reads"
    )
    late = [t for t in asked if t > signed_out + 1]
    assert late == [], f"{len(late)} request(s) after the sign-out"
    await expect(page.locator("#notice")).to_be_hidden()
    # Another token still in force: the page is back where it was, reading again.
    await sign_in(page, ADMIN)
    await expect(page.locator(table)).to_be_visible(timeout=WAIT_MS)
    if section == "commands":
        await expect(page.locator(f"{table} tbody tr")).to_have_count(1, timeout=WAIT_MS)
    assert errors.errors == []
