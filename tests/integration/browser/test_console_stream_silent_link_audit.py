"""The console's live stream over a link that dies without a word (no FIN, no reset: a
firewall or NAT that lost the connection's state, a cable pulled between two switches), in a
real browser against a real daemon, broker and PostgreSQL, through a TCP proxy that keeps the
connections open and forwards nothing."""

from __future__ import annotations

from playwright.async_api import Browser, expect

from tests.integration.browser.test_console_alarms import alarm_row, console_daemon, publish
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, require_chromium, sign_in
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.tcp_proxy import TcpProxy

# The gateway writes a comment every 15 s on a stream (KEEPALIVE_S): two of them missed, and
# a little more, is how long a dead link may still be said to be live.
SILENT_LINK_MS = 45_000


async def test_a_page_whose_link_died_silently_says_so_and_resumes_without_loss(
    db_dsn: str, mosquitto: Mosquitto, browser: Browser
) -> None:
    """The operator's link to the gateway goes dead without the connection being closed: the
    stream brings nothing any more, not even the gateway's keep-alive comment. The page must
    not go on saying "live" while alarms are raised that it never shows (the browser's own TCP
    keep-alive notices after minutes, or never when a box on the way still answers it): it
    says "reconnecting…", and once the link is back it resumes, and the alarm raised while it
    was cut is on the list without a reload."""
    require_chromium()
    port = free_port()
    async with (
        console_daemon(db_dsn, mosquitto, port),
        TcpProxy("127.0.0.1", port) as proxy,
    ):
        page, errors = await open_console(browser, f"http://127.0.0.1:{proxy.port}")
        await sign_in(page, OPERATOR)
        await publish(mosquitto, "before-1", {"metrics": {"temp": 91}})
        await expect(alarm_row(page, "before-1")).to_be_visible(timeout=WAIT_MS)
        await page.evaluate("window.__not_reloaded = true")

        proxy.black_hole()
        await publish(mosquitto, "during-1", {"metrics": {"temp": 92}})
        await expect(
            page.locator("#live"), "the page says live over a link that carries nothing"
        ).not_to_have_text("live", timeout=SILENT_LINK_MS)

        proxy.swallowing = False  # the link is back
        await expect(page.locator("#live")).to_have_text("live", timeout=SILENT_LINK_MS)
        await expect(alarm_row(page, "during-1")).to_be_visible(timeout=WAIT_MS)
        await publish(mosquitto, "after-1", {"metrics": {"temp": 93}})
        await expect(alarm_row(page, "after-1")).to_be_visible(timeout=WAIT_MS)
        await expect(alarm_row(page, "before-1")).to_have_count(1)
        assert await page.evaluate("window.__not_reloaded") is True
    assert errors.errors == []
