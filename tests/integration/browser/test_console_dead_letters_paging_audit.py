"""Dead letters past the first page: a letter replayed from the second page ("Older dead
letters") made the page read the first page alone again, and the letter, with every row
after the first 50, vanished from under the admin. A real daemon, PostgreSQL and chromium."""

from __future__ import annotations

import time

import asyncpg
import msgspec
from playwright.async_api import Browser, expect

from protocol import Topics
from storage import ingest as repo
from storage.ingest import DeadLetterRow
from tests.support.api_client import ADMIN
from tests.support.browser import WAIT_MS, open_console, sign_in

TOPICS = Topics("iot")
CONFIG = f"""
[[api.tokens]]
name = "root"
token = "{ADMIN}"
role = "admin"
"""


async def letters(dsn: str, count: int) -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        for n in range(count):
            body = msgspec.json.encode({"ts": int(time.time() * 1000), "metrics": {"t": n}})
            topic = TOPICS.telemetry(f"lab-{n:02d}")
            row = DeadLetterRow.whole(topic, body, "STORAGE_REJECTED", "then")
            await repo.insert_dead_letters(conn, [row], "earlier-node")
        ids = await conn.fetch("SELECT id FROM dead_letter ORDER BY id")
    finally:
        await conn.close()
    return [r["id"] for r in ids]


async def test_a_letter_replayed_from_the_second_page_stays_in_view_with_its_page(
    base: str, db_dsn: str, browser: Browser
) -> None:
    ids = await letters(db_dsn, 55)
    page, errors = await open_console(browser, base)
    await sign_in(page, ADMIN)
    await page.goto(f"{base}/#/dead-letters")
    rows = page.locator("#dead-letter-table tbody tr")
    await expect(rows).to_have_count(50, timeout=WAIT_MS)
    await page.get_by_role("button", name="Older dead letters").click()
    await expect(rows).to_have_count(55, timeout=WAIT_MS)
    oldest = page.locator(f"#dead-letter-table tbody tr[data-dead-letter-id='{ids[0]}']")
    await oldest.get_by_role("button", name="Replay").click()
    await expect(page.locator("#notice")).to_contain_text("replayed", timeout=WAIT_MS)
    await expect(oldest.locator(".replayed")).to_contain_text("stored", timeout=WAIT_MS)
    await expect(rows).to_have_count(55)
    shown = await rows.evaluate_all("rs => rs.map(r => Number(r.dataset.deadLetterId))")
    assert shown == sorted(ids, reverse=True), shown
    assert errors.errors == []
