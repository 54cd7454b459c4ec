"""A token's role lowered by a configuration reload (SIGHUP) while a console page is open:
the page kept the old role's header and buttons, each refused when clicked. On the first
refusal (403) it must learn the role the gateway now gives and show what that role allows.
A real daemon, PostgreSQL and chromium."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from playwright.async_api import Browser, expect

from gateway.runtime.daemon import Daemon
from tests.support.api_client import ADMIN, OPERATOR
from tests.support.browser import WAIT_MS, open_console, require_chromium, sign_in
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port


def tokens(olga: str) -> str:
    return f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "{olga}"

[[api.tokens]]
name = "root"
token = "{ADMIN}"
role = "admin"
"""


@pytest.fixture
async def rig(db_dsn: str, mosquitto: Mosquitto) -> AsyncIterator[tuple[str, Daemon, int]]:
    require_chromium()
    port = free_port()
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=tokens("operator")
    )
    async with running_daemon(config) as daemon:
        yield f"http://127.0.0.1:{port}", daemon, port


async def test_a_role_lowered_by_a_reload_is_shown_at_the_first_refusal(
    rig: tuple[str, Daemon, int], db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    base, daemon, port = rig
    async with (
        aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {OPERATOR}"}) as http,
        http.post("/devices/quiet-1/commands", json={"name": "open-valve"}) as reply,
    ):
        assert reply.status == 201, await reply.text()
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await expect(page.locator("#who")).to_have_text("olga (operator)")
    await page.goto(f"{base}/#/commands/quiet-1")
    row = page.locator("#command-table tbody tr").first
    cancel = row.get_by_role("button", name="Cancel")
    await expect(cancel).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#command-create")).to_be_visible()

    lowered = tokens("viewer")
    daemon.reload(make_config(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=lowered))
    await cancel.click()
    notice = page.locator("#notice")
    await expect(notice).to_contain_text("viewer role may not do this", timeout=WAIT_MS)
    # The page now shows the role the gateway gives: no buttons a viewer cannot use.
    await expect(page.locator("#who")).to_have_text("olga (viewer)", timeout=WAIT_MS)
    await expect(page.locator("#command-create")).to_be_hidden()
    await expect(row.get_by_role("button")).to_have_count(0)
    await expect(row.locator(".status")).not_to_have_text("CANCELLED")
    await expect(notice).to_contain_text("viewer role may not do this")
    assert errors.errors == []


async def test_an_admin_lowered_to_operator_leaves_the_dead_letters_saying_why(
    rig: tuple[str, Daemon, int], db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    base, daemon, port = rig
    page, errors = await open_console(browser, base)
    await sign_in(page, ADMIN)
    await page.goto(f"{base}/#/dead-letters")
    await expect(page.locator("#view-dead-letters")).to_be_visible(timeout=WAIT_MS)
    lowered = tokens("operator").replace('role = "admin"', 'role = "operator"')
    daemon.reload(make_config(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=lowered))
    await page.locator("#dead-letter-filters").get_by_role("button").first.click()
    await expect(page.locator("#who")).to_have_text("root (operator)", timeout=WAIT_MS)
    await expect(page.locator("#view-alarms")).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("#nav-dead-letters")).to_be_hidden()
    await expect(page.locator("#notice")).to_contain_text("Dead letters are for admins")
    assert errors.errors == []
