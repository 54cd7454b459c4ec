"""A webhook that refuses (a 503 in maintenance, a 429 rate limit, with ``Retry-After``) and
whose answer's body then never ends, or is cut short (the connection closed mid-body): its
status and ``Retry-After`` had arrived, but the body's stall (the attempt's ``timeout_s``) or
its cut (aiohttp's ``ClientPayloadError``) threw them away. The delivery said "no answer" of
a receiver that had answered, and was retried after the backoff's second or two instead of
the wait it asked for, spending its attempts inside the maintenance. Real PostgreSQL, a real
aiohttp receiver."""

from __future__ import annotations

import asyncio

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
from tests.integration.services.test_notify_retry_after import NOTIFY
from tests.support.receivers import Received, webhook_server
from tests.support.waiting import wait_until


def _refusing(status: int, *, cut: bool) -> object:
    """``status`` with ``Retry-After: 30`` and the first bytes of a 10,000-byte body, then
    nothing until the client hangs up (``cut``: the connection closed there)."""

    async def answer(request: web.Request, _got: Received, _status: int) -> web.StreamResponse:
        response = web.StreamResponse(status=status, headers={"Retry-After": "30"})
        response.content_length = 10_000
        await response.prepare(request)
        await response.write(b"down for maintenance ")
        if cut:
            assert request.transport is not None
            request.transport.close()
            return response
        await asyncio.Event().wait()  # stalls: the client's timeout ends it
        return response

    return answer


async def _first_attempt_failed(db: asyncpg.Connection) -> bool:
    rows = await _deliveries(db)
    return bool(rows) and rows[0]["attempts"] == 1 and rows[0]["status"] == "PENDING"


@pytest.mark.parametrize(
    ("status", "cut"), [(503, False), (429, True)], ids=["503-body-stalls", "429-body-cut"]
)
async def test_a_refusal_whose_body_stalls_or_is_cut_keeps_its_status_and_retry_after(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection, status: int, cut: bool
) -> None:
    async with webhook_server() as server:
        server.answers["/hook"] = _refusing(status, cut=cut)  # type: ignore[assignment]
        server.behaviours["/hook"] = lambda _n, _r: status
        config = _config(
            _webhook("hook", server.url("/hook"), "timeout_s = 0.5"), _route(["hook"]), NOTIFY
        )
        node = Notifier(pool, db_dsn, config)
        await _event(db, 1)
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _first_attempt_failed(db), message="first attempt failed")
    [row] = await _deliveries(db)
    now = await db.fetchval("SELECT now()")
    # What the receiver said, and the start of its body, as for any refusal.
    assert row["last_error"].startswith(f"HTTP {status}: down for maintenance"), row["last_error"]
    # And the wait it asked for (30 s), not the backoff's half second.
    wait = (row["next_attempt_at"] - now).total_seconds()
    assert 28.0 <= wait <= 30.5, f"retried in {wait:.1f} s, asked 30 s"
