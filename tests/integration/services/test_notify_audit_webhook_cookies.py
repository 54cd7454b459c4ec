"""Webhook receivers share one HTTP client, not its cookies: what one receiver's answer sets
is never sent to another receiver (nor back to it), whatever host they share."""

from __future__ import annotations

import asyncpg
from aiohttp import web

from tests.integration.services.test_notify import (
    Notifier,
    _config,
    _drain,
    _event,
    _route,
    _status_is,
    _webhook,
)
from tests.support.receivers import Received, webhook_server
from tests.support.waiting import wait_until

SESSION = "tenant-a-session-5f0c1d9e"


async def _set_cookie(_request: web.Request, _got: Received, status: int) -> web.StreamResponse:
    """Receiver A's answer: accepted, with a session cookie for the host."""
    response = web.Response(status=status, text="ok")
    response.set_cookie("session", SESSION, path="/")
    return response


async def test_a_cookie_one_receiver_sets_is_not_sent_to_another_receiver(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server() as server:
        server.answers["/a"] = _set_cookie
        # By name: a client keeps no cookie of a bare IP address.
        host = f"http://localhost:{server.port}"
        receivers = _webhook("a", f"{host}/a") + _webhook("b", f"{host}/b")
        routes = _route(["a"], 'devices = "dev-a"') + _route(["a", "b"], 'devices = "dev-b"')
        node = Notifier(pool, db_dsn, _config(receivers, routes))
        async with node.running():
            await _event(db, 1, device="dev-a")
            await _drain(node.consumer)
            await wait_until(lambda: _status_is(db, "SENT"), message="A's delivery SENT")
            # Then, on the same node (its one HTTP client), an event for B and A again.
            await _event(db, 2, device="dev-b")
            await _drain(node.consumer)
            await wait_until(lambda: _sent(db, 3), message="every delivery SENT")
    got = {(r.path, r.json["alarm_id"]): r.headers for r in server.received}
    assert set(got) == {("/a", 1), ("/a", 2), ("/b", 2)}
    # A's session is A's: B never gets it, and A is not sent it back either (each delivery
    # carries only the headers the documentation lists).
    assert got[("/b", 2)].get("Cookie") is None, got[("/b", 2)].get("Cookie")
    assert got[("/a", 2)].get("Cookie") is None, got[("/a", 2)].get("Cookie")


async def _sent(db: asyncpg.Connection, count: int) -> bool:
    sent = await db.fetchval("SELECT count(*) FROM notify_delivery WHERE status = 'SENT'")
    return bool(sent == count)
