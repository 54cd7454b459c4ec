"""A `Retry-After` HTTP date is read against the receiver's own `Date`, not the node's clock.

A receiver going into maintenance answers 503 with `Retry-After: <an HTTP date 40 s on>` (and,
as every HTTP server does, its `Date`). The node whose NTP broke, 10 minutes ahead, read that
date as 9 minutes 20 seconds past and retried on the backoff's next step: the receiver's ask
ignored, every attempt spent inside its maintenance, the delivery FAILED, the alarm told to
nobody there. RFC 9110 dates both headers on the server's clock: their difference is the wait
the server asked for, whatever either clock says. Real PostgreSQL, a real webhook receiver;
the node's wall clock (``time.time``) is set ahead, the receiver's is right."""

from __future__ import annotations

import time
from email.utils import formatdate

import asyncpg
import pytest
from aiohttp import web

from tests.integration.services.test_notify import Notifier, _config, _route, _webhook
from tests.integration.services.test_notify_retry_after import NOTIFY, _retry_in_s
from tests.support.receivers import Received, webhook_server

AHEAD_S = 600.0


async def test_a_node_whose_clock_is_ahead_waits_as_long_as_the_receiver_asked(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time  # the receiver's clock (and the database's): right

    async def in_maintenance(_request: web.Request, _got: Received, status: int) -> web.Response:
        now = real_time()
        headers = {
            "Date": formatdate(now, usegmt=True),
            "Retry-After": formatdate(now + 40, usegmt=True),
        }
        return web.Response(status=status, text="maintenance", headers=headers)

    monkeypatch.setattr(time, "time", lambda: real_time() + AHEAD_S)
    async with webhook_server() as server:
        server.answers["/hook"] = in_maintenance
        server.behaviours["/hook"] = lambda _n, _r: 503
        node = Notifier(
            pool, db_dsn, _config(_webhook("hook", server.url("/hook")), _route(["hook"]), NOTIFY)
        )
        wait = await _retry_in_s(db, node)
    assert 38.0 <= wait <= 41.0, f"retried in {wait:.1f} s, asked 40 s"
