"""A dead letter's Replay or Discard whose answer is lost on the way back (a proxy cut, a
node restarting after its COMMIT): the page must not say "Could not replay" / "Could not
discard" of what the gateway did. A real daemon, PostgreSQL and chromium; the answer dropped
by Playwright after the gateway has handled the request."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import asyncpg
import msgspec
from playwright.async_api import Browser, Route, expect

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


async def letter(dsn: str, device: str) -> int:
    body = msgspec.json.encode({"ts": int(time.time() * 1000), "metrics": {"temp": 20}})
    row = DeadLetterRow.whole(TOPICS.telemetry(device), body, "STORAGE_REJECTED", "then")
    conn = await asyncpg.connect(dsn)
    try:
        await repo.insert_dead_letters(conn, [row], "earlier-node")
        found = await conn.fetchval(
            "SELECT id FROM dead_letter WHERE topic = $1", TOPICS.telemetry(device)
        )
    finally:
        await conn.close()
    return int(found)


async def fetchval(dsn: str, sql: str, *args: object) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


def losing(handled: list[int], method: str) -> Callable[[Route], Awaitable[None]]:
    async def lose_the_answer(route: Route) -> None:
        if route.request.method != method:
            await route.continue_()
            return
        response = await route.fetch()  # the gateway does it ...
        handled.append(response.status)
        await route.abort("connectionreset")  # ... and its answer never reaches the page

    return lose_the_answer


async def test_a_replay_whose_answer_was_lost_is_not_said_to_have_failed(
    base: str, db_dsn: str, browser: Browser
) -> None:
    letter_id = await letter(db_dsn, "lab-1")
    page, errors = await open_console(browser, base)
    await sign_in(page, ADMIN)
    await page.goto(f"{base}/#/dead-letters")
    row = page.locator(f"#dead-letter-table tbody tr[data-dead-letter-id='{letter_id}']")
    await expect(row.locator(".replayed")).to_have_text("no", timeout=WAIT_MS)
    handled: list[int] = []
    lose = losing(handled, "POST")
    await page.route("**/replay", lose)
    await row.get_by_role("button", name="Replay").click()
    # The gateway replayed it: the row says so, and so must the notice.
    await expect(row.locator(".replayed")).to_contain_text("stored", timeout=WAIT_MS)
    assert handled == [200], handled
    notice = page.locator("#notice")
    await expect(notice).to_contain_text(f"Dead letter {letter_id} replayed", timeout=WAIT_MS)
    await expect(notice).not_to_contain_text("Could not")
    replays = await fetchval(
        db_dsn, "SELECT replay_count FROM dead_letter WHERE id = $1", letter_id
    )
    assert replays == 1
    assert errors.errors == []


async def test_a_discard_whose_answer_was_lost_is_not_said_to_have_failed(
    base: str, db_dsn: str, browser: Browser
) -> None:
    letter_id = await letter(db_dsn, "lab-2")
    page, errors = await open_console(browser, base)
    await sign_in(page, ADMIN)
    await page.goto(f"{base}/#/dead-letters/{letter_id}")
    detail = page.locator("#dead-letter-detail")
    await expect(detail).to_be_visible(timeout=WAIT_MS)
    handled: list[int] = []
    await page.route(f"**/dead-letters/{letter_id}", losing(handled, "DELETE"))
    await detail.get_by_role("button", name="Discard…").click()
    await detail.get_by_role("button", name="Discard dead letter").click()
    notice = page.locator("#notice")
    await expect(notice).to_contain_text(f"Dead letter {letter_id} discarded", timeout=WAIT_MS)
    assert handled == [200], handled
    await expect(notice).not_to_contain_text("Could not")
    rows = page.locator(f"#dead-letter-table tbody tr[data-dead-letter-id='{letter_id}']")
    await expect(rows).to_have_count(0)
    assert await fetchval(db_dsn, "SELECT count(*) FROM dead_letter WHERE id = $1", letter_id) == 0
    assert errors.errors == []
