"""The console behind a real nginx at a path prefix (``https://ops.example.com/gateway/`` →
``proxy_pass http://127.0.0.1:8080/``), in a real browser against a real daemon, broker and
PostgreSQL: the page, its modules, the API and the live stream all under the prefix."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.async_api import Browser, Response, expect

from tests.integration.browser.test_console_alarms import alarm_row, console_daemon, publish
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, require_chromium, sign_in
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

PREFIX = "/gateway"


def _nginx() -> str:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if found is None:
        pytest.skip("no nginx (apt-get install nginx-light; .ci/run installs it)")
    return found


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


def _write_conf(tmp: Path, port: int, upstream_port: int) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    conf = tmp / "nginx.conf"
    temps = "\n".join(
        f"    {kind}_temp_path {tmp / kind};" for kind in ("client_body", "proxy", "fastcgi")
    )
    conf.write_text(
        f"""
worker_processes 1;
pid {tmp / "nginx.pid"};
error_log {tmp / "error.log"} warn;
events {{ worker_connections 64; }}
http {{
    access_log {tmp / "access.log"};
{temps}
    server {{
        listen 127.0.0.1:{port};
        location {PREFIX}/ {{
            proxy_pass http://127.0.0.1:{upstream_port}/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 60s;
            proxy_pass_header Date;
        }}
    }}
}}
"""
    )
    return conf


@contextlib.asynccontextmanager
async def nginx_prefix(tmp: Path, upstream_port: int) -> AsyncIterator[int]:
    """A private nginx on a free port: ``/gateway/`` proxied to the daemon's root, as
    docs/deploying.md ("Behind a reverse proxy") says; its port."""
    binary = _nginx()
    port = free_port()
    while port == upstream_port:  # the daemon's, not bound yet when nginx comes first
        port = free_port()
    conf = _write_conf(tmp, port, upstream_port)
    process = await asyncio.create_subprocess_exec(
        binary, "-c", str(conf), "-p", str(tmp), "-g", "daemon off;"
    )
    try:
        await wait_until(
            lambda: process.returncode is not None or _accepts(port),
            timeout=10,
            message="nginx listening",
        )
        assert process.returncode is None, (tmp / "error.log").read_text()
        yield port
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()


async def test_the_console_under_a_path_prefix_loads_signs_in_goes_live_and_acts(
    db_dsn: str, mosquitto: Mosquitto, browser: Browser, tmp_path: Path
) -> None:
    """An operator opens ``http://host/gateway/``: the page's stylesheet and modules come from
    under the prefix (not the site's root, where they 404 and the page stays a bare form), the
    sign-in and the alarm list are read through the proxy, an alarm raised by telemetry comes
    in on the live stream, and Confirm works."""
    require_chromium()
    _nginx()
    daemon_port = free_port()
    async with (
        console_daemon(db_dsn, mosquitto, daemon_port),
        nginx_prefix(tmp_path / "nginx", daemon_port) as port,
    ):
        base = f"http://127.0.0.1:{port}{PREFIX}"
        failed: list[str] = []
        paths: list[str] = []
        page, errors = await open_console(browser, base)

        def record(response: Response) -> None:
            paths.append(urlsplit(response.url).path)
            if response.status >= 400:
                failed.append(f"{response.status} {urlsplit(response.url).path}")

        page.on("response", record)
        await page.reload()
        await page.wait_for_load_state("load")
        # The stylesheet and the modules came, from under the prefix (not the site's root).
        assert failed == [], failed
        await sign_in(page, OPERATOR)
        await expect(page.locator("#who")).to_have_text("olga (operator)")
        await expect(page.locator("#alarm-empty")).to_be_visible(timeout=WAIT_MS)
        await page.evaluate("window.__not_reloaded = true")

        await publish(mosquitto, "boiler-9", {"metrics": {"temp": 95}})
        row = alarm_row(page, "boiler-9")
        await expect(row).to_be_visible(timeout=WAIT_MS)
        assert await page.evaluate("window.__not_reloaded") is True

        await row.get_by_role("link", name="#").first.click()
        detail = page.locator("#alarm-detail")
        await detail.get_by_role("button", name="Confirm").click()
        await expect(detail.locator("#alarm-status")).to_have_text("CONFIRMED", timeout=WAIT_MS)

        assert failed == [], failed
        assert errors.errors == []
        # Every request of the page went through the prefix: none to the site's root.
        outside = [p for p in paths if not p.startswith(f"{PREFIX}/")]
        assert outside == [], outside
        assert f"{PREFIX}/stream" in paths


async def test_behind_the_proxy_a_gateway_that_is_down_is_said_so_not_shown_as_markup(
    db_dsn: str, mosquitto: Mosquitto, browser: Browser, tmp_path: Path
) -> None:
    """The daemon restarts (or dies) while the page is open behind nginx: the proxy answers
    502 with its own HTML page. A button pressed then must say the gateway does not answer,
    as it does without a proxy, not print nginx's markup into the notice."""
    require_chromium()
    _nginx()
    daemon_port = free_port()
    async with nginx_prefix(tmp_path / "nginx", daemon_port) as port:
        async with console_daemon(db_dsn, mosquitto, daemon_port):
            page, errors = await open_console(browser, f"http://127.0.0.1:{port}{PREFIX}")
            await sign_in(page, OPERATOR)
            await publish(mosquitto, "boiler-7", {"metrics": {"temp": 95}})
            row = alarm_row(page, "boiler-7")
            await expect(row).to_be_visible(timeout=WAIT_MS)
            await row.get_by_role("link", name="#").first.click()
            detail = page.locator("#alarm-detail")
            await expect(detail.get_by_role("button", name="Confirm")).to_be_visible(
                timeout=WAIT_MS
            )
        await detail.get_by_role("button", name="Confirm").click()
        notice = page.locator("#notice")
        await expect(notice).to_be_visible(timeout=WAIT_MS)
        text = await notice.inner_text()
        assert "<" not in text, text
        assert "does not answer" in text, text
        # Back: the stream comes again through the proxy, and the button works.
        async with console_daemon(db_dsn, mosquitto, daemon_port):
            await expect(page.locator("#live")).to_have_text("live", timeout=WAIT_MS)
            await detail.get_by_role("button", name="Confirm").click()
            await expect(detail.locator("#alarm-status")).to_have_text("CONFIRMED", timeout=WAIT_MS)
        assert errors.errors == []
