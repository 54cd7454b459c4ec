"""A webhook's signature is dated on the database's clock, not on the sending node's.

One node of three whose NTP broke runs 10 minutes behind the database (and the world). A
receiver checks signatures as docs/notifications.md tells it to: the HMAC, and a `t` no more
than a few minutes from its own clock (a replayed request carries an old one). Every
notification that node sent carried its own wrong time: refused, attempt after attempt, until
the delivery ended FAILED and the alarm reached nobody that way. Real PostgreSQL, a real HTTP
receiver; the node's wall clock (``time.time``) is set back, the database's is not."""

from __future__ import annotations

import time

import asyncpg
import pytest

from gateway.domain.notify import verify_signature
from tests.integration.services.test_notify import (
    SECRET,
    Notifier,
    _config,
    _deliveries,
    _drain,
    _event,
    _route,
    _status_is,
    _webhook,
)
from tests.support.receivers import Received, webhook_server
from tests.support.waiting import wait_until

BEHIND_S = 600.0


async def test_a_node_whose_clock_is_behind_signs_webhooks_a_receiver_accepts(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time  # the receiver's clock, and the database's: right

    def checks(_n: int, got: Received) -> int:
        header = got.headers.get("X-Gateway-Signature", "")
        fresh = verify_signature(SECRET, header, got.body, now=int(real_time()), tolerance_s=300)
        return 200 if fresh else 401

    async with webhook_server(hook=checks) as server:
        config = _config(
            _webhook("hook", server.url("/hook"), f'secret = "{SECRET}"'), _route(["hook"])
        )
        node = Notifier(pool, db_dsn, config)
        await _event(db, 1)
        await _drain(node.consumer)
        monkeypatch.setattr(time, "time", lambda: real_time() - BEHIND_S)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT", "FAILED"), message="its end")
    [delivery] = await _deliveries(db)
    assert (delivery["status"], delivery["attempts"], delivery["last_error"]) == ("SENT", 1, None)
    [request] = server.on("/hook")
    signed_at = int(request.headers["X-Gateway-Signature"].split(",")[0].removeprefix("t="))
    assert abs(signed_at - real_time()) < 60
