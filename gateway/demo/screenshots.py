"""Photographs of the console, for anyone who wants to see the page without running a browser.

Used by ``gateway demo --screenshots OUTDIR``: Debian's chromium, driven by Playwright (a dev
dependency, imported only here), signs in with the demo's token, waits for open alarms, and
saves the alarm list, the most severe alarm's detail and the campaign form at its confirmation
at each size as PNG files. And by
``gateway demo --measure-live N``: how long an alarm takes from its telemetry to an open page.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from playwright.async_api import Browser, Page, async_playwright, expect

WAIT_MS: Final = 90_000
# The calm demo raises a few alarms a minute: three rows come within about a minute.
MIN_ALARMS: Final = 3


async def _signed_in(page: Page, url: str, token: str) -> None:
    await page.goto(url)
    await page.get_by_label("API token").fill(token)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#live")).to_have_text("live", timeout=WAIT_MS)


@contextlib.asynccontextmanager
async def launch_chromium(chromium: Path) -> AsyncIterator[Browser]:
    """Debian's chromium, headless (as root it needs --no-sandbox), closed on the way out."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(chromium), args=["--no-sandbox"], headless=True
        )
        try:
            yield browser
        finally:
            await browser.close()


async def take_screenshots(
    url: str,
    token: str,
    outdir: Path,
    chromium: Path,
    sizes: Mapping[str, tuple[int, int]],
) -> list[Path]:
    await asyncio.to_thread(outdir.mkdir, parents=True, exist_ok=True)
    written: list[Path] = []
    async with launch_chromium(chromium) as browser:
        for label, (width, height) in sizes.items():
            context = await browser.new_context(viewport={"width": width, "height": height})
            page = await context.new_page()
            await _signed_in(page, url, token)
            # Open alarms in both of the list's tables: active, then returned to normal.
            rows = page.locator("#alarm-table tbody tr, #alarm-returned tbody tr")
            await expect(rows.nth(MIN_ALARMS - 1)).to_be_visible(timeout=WAIT_MS)
            listing = outdir / f"console-alarms-{label}.png"
            await page.screenshot(path=str(listing))
            # Each table is ordered most severe first: the first active alarm is the one to show.
            await rows.first.get_by_role("link").first.click()
            await expect(page.locator("#alarm-detail .audit li").first).to_be_visible(
                timeout=WAIT_MS
            )
            await page.locator("#alarm-detail").scroll_into_view_if_needed()
            detail = outdir / f"console-alarm-detail-{label}.png"
            await page.screenshot(path=str(detail))
            written += [
                listing,
                detail,
                await _campaign_form(page, outdir / f"console-campaign-{label}.png"),
            ]
            await context.close()
    return written


async def _campaign_form(page: Page, path: Path) -> Path:
    """The campaign form filled in, its selector counted, at its confirmation; nothing is
    started (Back)."""
    await page.get_by_role("link", name="Campaigns").click()
    form = page.locator("#campaign-create")
    await form.get_by_label("Command", exact=True).fill("set-interval")
    await form.get_by_label("Params (JSON object)").fill('{"seconds": 30}')
    await form.get_by_label("Targets (selector)").fill("demo-0000*")
    await expect(page.locator("#campaign-target-count")).to_contain_text("match:", timeout=WAIT_MS)
    await form.get_by_label("Rollout: commands per minute").fill("60")
    await form.get_by_label("Abort when failed").fill("20")
    await form.get_by_label("once finished").fill("10")
    await form.get_by_role("button", name="Review campaign").click()
    await expect(page.locator("#campaign-confirm")).to_be_visible(timeout=WAIT_MS)
    await page.locator("#view-campaigns").scroll_into_view_if_needed()
    await page.screenshot(path=str(path))
    await page.get_by_role("button", name="Back").click()
    return path


# Records, in the page, when a row naming each watched device first shows in the alarm list
# (a MutationObserver fires as the DOM changes: no polling interval adds to the figure).
_WATCH_ROWS: Final = """devices => {
    window.__alarmSeen = window.__alarmSeen || {};
    const look = () => {
        for (const row of document.querySelectorAll('#alarm-table tbody tr')) {
            for (const device of devices) {
                if (!(device in window.__alarmSeen) && row.textContent.includes(device)) {
                    window.__alarmSeen[device] = Date.now();
                }
            }
        }
    };
    new MutationObserver(look).observe(document.body, {childList: true, subtree: true});
    look();
}"""


async def measure_live_alarms(
    url: str,
    token: str,
    chromium: Path,
    devices: Sequence[str],
    spike: Callable[[str], Awaitable[None]],
) -> list[float]:
    """For each device in turn: ``spike`` it (telemetry that raises an alarm) and time, in
    milliseconds, from just before the publish to its row showing in an open, signed-in page
    that is never reloaded. Both clocks are this machine's wall clock."""
    async with launch_chromium(chromium) as browser:
        page = await browser.new_page(viewport={"width": 1280, "height": 800})
        await _signed_in(page, url, token)
        await page.evaluate(_WATCH_ROWS, list(devices))
        millis: list[float] = []
        for device in devices:
            started = time.time() * 1000
            await spike(device)
            await page.wait_for_function(
                "device => device in (window.__alarmSeen || {})", arg=device, timeout=WAIT_MS
            )
            seen = await page.evaluate("device => window.__alarmSeen[device]", device)
            millis.append(float(seen) - started)
        return millis
