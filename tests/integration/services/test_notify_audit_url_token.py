"""A webhook URL that is itself the credential (Slack, Discord, Teams, Google Chat: a token in
its path or query) keeps it out of ``last_error`` and the log when the receiver's refusal
echoes the request's path, as a framework's 404 page does ("Cannot POST /services/...")."""

from __future__ import annotations

import asyncpg
import msgspec
from aiohttp import web
from structlog.testing import capture_logs

from tests.integration.services.test_notify import (
    FAST,
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

PATH_TOKEN = "xoxbPathToken0123456789ab"
KEY = "AIzaSyQueryKey0123456789"


async def _not_found(request: web.Request, _got: Received, status: int) -> web.StreamResponse:
    """Express's default 404, with the query too: the request's path echoed."""
    return web.Response(status=404, text=f"Cannot POST {request.path_qs}")


async def test_a_token_in_the_webhook_urls_path_or_query_is_not_shown_when_echoed(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    path = f"/services/T0123ABCD/B0456EFGH/{PATH_TOKEN}"
    async with webhook_server() as server:
        server.answers[path] = _not_found
        url = server.url(f"{path}?key={KEY}&threadKey=ops")
        config = _config(
            _webhook("chat", url),
            _route(["chat"]),
            FAST.replace("max_attempts = 5", "max_attempts = 2"),
        )
        node = Notifier(pool, db_dsn, config)
        await _event(db, 1)
        await _drain(node.consumer)
        with capture_logs() as logs:
            async with node.running():
                await wait_until(lambda: _status_is(db, "FAILED"), message="delivery FAILED")
    # The receiver did echo the token: what follows means something.
    assert len(server.on(path)) == 2
    [row] = await _deliveries(db)
    assert row["last_error"].startswith("HTTP 404: Cannot POST "), row["last_error"]
    shown = [row["last_error"], *(msgspec.json.encode(e).decode() for e in logs)]
    for text in shown:
        assert PATH_TOKEN not in text, text
        assert KEY not in text, text
