"""A receiver that asks to be retried later: `429 Too Many Requests` (Slack's, Teams' and most
chat webhooks' rate limit during an alarm storm) or `503 Service Unavailable` with a
`Retry-After` header, in seconds or as an HTTP date. The next attempt waits at least that
long (capped at backoff_max_s), instead of the backoff's second or two that spent the
delivery's attempts inside the receiver's own window and ended it FAILED. Real PostgreSQL, a
real webhook receiver."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import asyncpg
import pytest
from aiohttp import web

from tests.integration.services.test_notify import (
    Notifier,
    _config,
    _deliveries,
    _drain,
    _event,
    _route,
    _webhook,
)
from tests.support.receivers import Received, webhook_server
from tests.support.waiting import wait_until

# Attempts enough, and a backoff of a second at most: what a rate limit of 30 s makes of it.
NOTIFY = """
[notify]
max_attempts = 5
backoff_min_s = 0.5
backoff_max_s = 600
poll_s = 0.05
lease_s = 30
"""


def _asking(value: str, status: int) -> object:
    async def answer(_request: web.Request, _got: Received, _status: int) -> web.Response:
        return web.Response(status=status, text="slow down", headers={"Retry-After": value})

    return answer


async def _first_attempt_failed(db: asyncpg.Connection) -> bool:
    rows = await _deliveries(db)
    return bool(rows) and rows[0]["attempts"] == 1 and rows[0]["status"] == "PENDING"


async def _retry_in_s(db: asyncpg.Connection, node: Notifier) -> float:
    await _event(db, 1)
    await _drain(node.consumer)
    async with node.running():
        await wait_until(lambda: _first_attempt_failed(db), message="the first attempt failed")
    [row] = await _deliveries(db)
    now = await db.fetchval("SELECT now()")
    assert row["last_error"].startswith("HTTP ")
    return float((row["next_attempt_at"] - now).total_seconds())


def _in(seconds: float) -> str:
    return format_datetime(datetime.now(UTC) + timedelta(seconds=seconds), usegmt=True)


@pytest.mark.parametrize(
    ("status", "value", "at_least", "at_most"),
    [
        (429, "30", 29.0, 30.5),
        (503, "45", 44.0, 45.5),
        (429, "in an HTTP date, 40 s", 38.0, 41.0),
        (429, "9999999", 598.0, 600.5),  # a year: capped at backoff_max_s
    ],
    ids=["429-seconds", "503-seconds", "429-http-date", "capped"],
)
async def test_a_receiver_asking_to_retry_later_is_retried_no_sooner(
    *,
    pool: asyncpg.Pool,
    db_dsn: str,
    db: asyncpg.Connection,
    status: int,
    value: str,
    at_least: float,
    at_most: float,
) -> None:
    """The first attempt is refused with Retry-After: the delivery waits that long. It used
    to be retried within a second (the backoff's first step), and again within two, four,
    eight: five attempts in about fifteen seconds, all inside the receiver's rate limit, and
    the delivery FAILED, nobody told of the alarm."""
    if value.startswith("in an HTTP date"):
        value = _in(40)
    async with webhook_server() as server:
        server.answers["/hook"] = _asking(value, status)  # type: ignore[assignment]
        server.behaviours["/hook"] = lambda _n, _r: status
        node = Notifier(
            pool, db_dsn, _config(_webhook("hook", server.url("/hook")), _route(["hook"]), NOTIFY)
        )
        wait = await _retry_in_s(db, node)
    assert at_least <= wait <= at_most, f"retried in {wait:.1f} s, asked {value!r}"


@pytest.mark.parametrize("value", ["soon", "-5", "", "Wed, 99 Foo 2026 00:00:00 GMT"])
async def test_a_retry_after_that_says_nothing_usable_leaves_the_backoff(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection, value: str
) -> None:
    """A header that is no number of seconds and no date (or one in the past) is ignored:
    the backoff's own delay, as for any failed attempt."""
    async with webhook_server() as server:
        server.answers["/hook"] = _asking(value, 429)  # type: ignore[assignment]
        server.behaviours["/hook"] = lambda _n, _r: 429
        node = Notifier(
            pool, db_dsn, _config(_webhook("hook", server.url("/hook")), _route(["hook"]), NOTIFY)
        )
        wait = await _retry_in_s(db, node)
    assert wait <= 0.6, f"retried in {wait:.1f} s"
