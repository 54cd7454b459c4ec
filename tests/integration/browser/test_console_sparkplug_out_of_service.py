"""A Sparkplug device put out of service from its page in the console, and back. The page's
buttons sent `PUT`/`DELETE /devices/{id}/out-of-service`, where the id's `/` splits the path:
"no route PUT /devices/Plant1/Line4/Oven/out-of-service", nothing done. They send the id in the
query now (`/device/out-of-service?id=`), for every device alike."""

from __future__ import annotations

import asyncpg
from playwright.async_api import Browser, expect

from tests.integration.browser.test_console_operations import CONFIG  # noqa: F401 - the console's (its `base`)
from tests.support.api_client import OPERATOR
from tests.support.browser import WAIT_MS, open_console, sign_in

OVEN = "Plant1/Line4/Oven"


async def test_a_sparkplug_device_goes_out_of_service_from_its_page_and_back(
    base: str,
    db_dsn: str,
    browser: Browser,
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "INSERT INTO device (device_id, first_seen, last_seen) VALUES ($1, now(), now())", OVEN
        )
    finally:
        await conn.close()
    page, errors = await open_console(browser, base)
    await sign_in(page, OPERATOR)
    await page.get_by_role("link", name="Devices").click()
    await page.get_by_role("link", name=OVEN, exact=True).click()
    detail = page.locator("#device-detail")
    await expect(detail.locator("h3").first).to_have_text(OVEN, timeout=WAIT_MS)
    await detail.get_by_label("Maintenance reason").fill("door seal")
    await detail.get_by_role("button", name="Put out of service").click()
    await expect(detail.locator(".out-of-service")).to_contain_text(
        "out of service since", timeout=WAIT_MS
    )
    await expect(detail.locator(".out-of-service")).to_contain_text("door seal (olga)")
    await detail.get_by_role("button", name="Back in service").click()
    await expect(detail.locator(".out-of-service")).to_have_text("in service", timeout=WAIT_MS)
    assert errors.errors == []
