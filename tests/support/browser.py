"""Debian's chromium driven by Playwright, for the console's tests; a console on a real daemon.

Playwright's own browser download cannot be fetched here, so the browser is the system's
(``apt-get install chromium``), named by ``executable_path``. Tests skip, saying why, only when
that binary is absent; ``.ci/run`` installs it, so in CI they run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Final
from urllib.parse import urlsplit

import pytest
from playwright.async_api import Browser, Page, Request, expect

from gateway.demo.run import CHROMIUM
from gateway.demo.screenshots import launch_chromium
from tests.support.waiting import wait_until

# Generous for a loaded CI machine; every wait is on a condition, never a sleep.
WAIT_MS: Final = 20_000
DESKTOP: Final = {"width": 1280, "height": 800}
PHONE: Final = {"width": 390, "height": 844}


def require_chromium() -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    require_chromium()
    async with launch_chromium(CHROMIUM) as browser:
        yield browser


class PageErrors:
    """Uncaught errors of the page's scripts: a test fails on any."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("pageerror", lambda error: self.errors.append(str(error)))


class Requests:
    """The page's requests in flight, but for its live stream (one request that lasts as long
    as the page: Playwright's "networkidle" never comes while it stands)."""

    QUIET_S: Final = 0.5  # as "networkidle": this long without any

    def __init__(self, page: Page) -> None:
        self.pending: set[Request] = set()
        self.last = time.monotonic()
        page.on("request", self._started)
        page.on("requestfinished", self._ended)
        page.on("requestfailed", self._ended)

    def _started(self, request: Request) -> None:
        if urlsplit(request.url).path != "/stream":
            self.pending.add(request)
            self.last = time.monotonic()

    def _ended(self, request: Request) -> None:
        if request in self.pending:
            self.pending.discard(request)
            self.last = time.monotonic()

    async def settled(self) -> None:
        """Once no request but the stream has been in flight for ``QUIET_S``."""
        await wait_until(
            lambda: not self.pending and time.monotonic() - self.last >= self.QUIET_S,
            timeout=WAIT_MS / 1000,
            message=f"requests still in flight: {[r.url for r in self.pending]}",
        )


async def open_console(
    browser: Browser, base: str, *, viewport: dict[str, int] | None = None
) -> tuple[Page, PageErrors]:
    context = await browser.new_context(viewport=viewport or DESKTOP)  # type: ignore[arg-type]  # a ViewportSize TypedDict
    page = await context.new_page()
    errors = PageErrors(page)
    await page.goto(f"{base}/")
    return page, errors


async def sign_in(page: Page, token: str) -> None:
    await page.get_by_label("API token").fill(token)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#who")).not_to_be_empty(timeout=WAIT_MS)
    await expect(page.locator("#live")).to_have_text("live", timeout=WAIT_MS)
