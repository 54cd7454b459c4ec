"""The fixtures every console test shares: a browser, and a console served by a real daemon
(with its broker and PostgreSQL)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Browser

from tests.integration.browser.test_console_alarms import Console, console_daemon
from tests.support.browser import chromium, require_chromium
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as launched:
        yield launched


@pytest.fixture
async def console(db_dsn: str, mosquitto: Mosquitto) -> AsyncIterator[Console]:
    require_chromium()
    port = free_port()
    async with console_daemon(db_dsn, mosquitto, port) as daemon:
        yield Console(f"http://127.0.0.1:{port}", daemon, mosquitto)


@pytest.fixture
async def base(
    request: pytest.FixtureRequest, db_dsn: str, mosquitto: Mosquitto
) -> AsyncIterator[str]:
    """The address of a console served by a real daemon whose configuration adds the test
    module's ``CONFIG`` (its tokens, its rules)."""
    require_chromium()
    port = free_port()
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=request.module.CONFIG
    )
    async with running_daemon(config):
        yield f"http://127.0.0.1:{port}"
