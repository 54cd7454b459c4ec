"""A Sparkplug device's page in the console: the newcomer's `gateway demo` lists
`Demo/Line1/Oven` among its devices, and clicking it opens its page with its latest metrics and
the chart of one of them. The page read the device and its samples at `/devices/{id}` and
`/devices/{id}/telemetry`, where the id's `/` splits the path: it said "no route GET
/devices/Demo/Line1/Oven" and showed nothing. It reads them by the query now (`GET /device?id=`,
`GET /device/telemetry?id=`), for every device alike, and the rules to draw across the chart
with `GET /rules?device=`, which refused a Sparkplug id (400)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Browser, expect

from tests.integration.browser.test_console_operations import CONFIG, stored
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, require_chromium, sign_in
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

GROUP = "sim-plant"
DEVICE = f"{GROUP}/edge-00000/pub-00000"  # gateway-sim's first Sparkplug device
SPARKPLUG = f"""
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["{GROUP}"]

[[rules]]
key = "plant-hot"
kind = "threshold"
metric = "temp"
op = ">"
value = 1000
severity = "MAJOR"
devices = "{GROUP}/*"
"""


@pytest.fixture
async def base(db_dsn: str, mosquitto: Mosquitto) -> AsyncIterator[str]:
    require_chromium()
    port = free_port()
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=CONFIG + SPARKPLUG
    )
    async with running_daemon(config):
        yield f"http://127.0.0.1:{port}"


async def test_a_sparkplug_devices_page_opens_with_its_metrics_and_chart(
    base: str, db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    published = await asyncio.to_thread(
        subprocess.run,
        [
            *(sys.executable, "-m", "sim", "publish", "--format", "sparkplug"),
            *("--sparkplug-group", GROUP, "--host", "127.0.0.1", "--port", str(mosquitto.port)),
            *("--devices", "1", "--messages", "6"),
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert published.returncode == 0, published.stderr
    # Its DBIRTH and four DDATA, each a sample carrying `temp`.
    await wait_until(lambda: stored(db_dsn, DEVICE, 5), timeout=60, message="5 samples stored")
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.get_by_role("link", name="Devices").click()
    await page.get_by_role("link", name=DEVICE, exact=True).click()
    detail = page.locator("#device-detail")
    await expect(detail.locator("h3").first).to_have_text(DEVICE, timeout=WAIT_MS)
    await expect(detail.locator(".metric[data-metric='temp'] .value")).not_to_be_empty()
    await page.get_by_role("button", name="Chart temp").click()
    chart = detail.locator("svg.chart polyline")
    await expect(chart).to_have_count(1, timeout=WAIT_MS)
    # The rule on the device's metric (`GET /rules?device=` took no Sparkplug id either).
    await expect(detail.locator("svg.chart .rule-trigger text")).to_have_text(
        "plant-hot: fires > 1000"
    )
    assert len((await chart.get_attribute("points") or "").split()) == 5
    await expect(detail.locator(".error")).to_have_count(0)
    assert errors.errors == []
