"""HEAD is GET without the body (RFC 9110 §9.3.2: "all general-purpose servers MUST support
the methods GET and HEAD"). Monitors probe with it (`curl -I`, uptime checkers whose HTTP
check sends HEAD): a 405 on `HEAD /health` reads as the gateway being down. Every path that
answers GET answers HEAD with GET's status and headers, the token checked as for GET; the live
stream, whose body never ends, is the exception (405, as any method a path does not serve).
Real HTTP against the served app and a real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from gateway.config import TokenConfig
from tests.support.api_client import ADMIN, VIEWER
from tests.support.api_server import Served, serve_api

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]
BEARER = {"Authorization": f"Bearer {VIEWER}"}
# Headers that differ between two answers of the same content.
PER_ANSWER = {"date", "x-request-id"}


@pytest.fixture
async def served(db_dsn: str) -> AsyncIterator[Served]:
    async with serve_api(db_dsn, TOKENS) as served:
        yield served


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _allow(headers: object) -> set[str]:
    assert isinstance(headers, aiohttp.typedefs.CIMultiDictProxy)
    return {m.strip() for m in headers["Allow"].split(",")}


async def _same_as_get(
    http: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    varying: frozenset[str] = frozenset(),
) -> int:
    """HEAD's status and headers are GET's (but ``varying``, which two GETs differ in too),
    and it has no body."""
    left_out = PER_ANSWER | varying
    async with http.get(url, headers=headers) as got:
        await got.read()
        expected = {k.lower(): v for k, v in got.headers.items() if k.lower() not in left_out}
        status = got.status
    async with http.head(url, headers=headers) as head:
        body = await head.read()
        answered = {k.lower(): v for k, v in head.headers.items() if k.lower() not in left_out}
        assert (head.status, body) == (status, b""), url
    assert answered == expected, url
    return status


async def test_every_get_path_answers_head_with_gets_status_and_headers(
    served: Served, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    base = served.base
    assert await _same_as_get(http, f"{base}/health", {}) == 200
    # The figures move between two scrapes (the requests are counted): their length too.
    metrics = await _same_as_get(http, f"{base}/metrics", {}, frozenset({"content-length"}))
    assert metrics == 200
    assert await _same_as_get(http, f"{base}/openapi.json", {}) == 200
    assert await _same_as_get(http, f"{base}/alarms?limit=5", BEARER) == 200
    assert await _same_as_get(http, f"{base}/devices", BEARER) == 200
    assert await _same_as_get(http, f"{base}/alarms/424242", BEARER) == 404
    # The token is checked as for GET: none is 401, a role too weak 403.
    assert await _same_as_get(http, f"{base}/alarms", {}) == 401
    assert await _same_as_get(http, f"{base}/dead-letters", BEARER) == 403
    # A path that does not serve GET does not serve HEAD either.
    async with http.head(f"{base}/alarms/bulk", headers=BEARER) as head:
        assert head.status == 405
        assert "HEAD" not in _allow(head.headers)
    # OPTIONS names HEAD wherever GET is.
    async with http.options(f"{base}/alarms") as options:
        assert options.status == 204
        assert _allow(options.headers) == {"GET", "HEAD", "OPTIONS"}


async def test_the_stream_does_not_answer_head(served: Served, http: aiohttp.ClientSession) -> None:
    """Its body never ends: HEAD would open a stream (a place among `max_streams`) for a
    client that reads no body. It is refused as any method the path does not serve."""
    async with http.head(f"{served.base}/stream", headers=BEARER) as head:
        assert head.status == 405
        assert _allow(head.headers) == {"GET", "OPTIONS"}
    assert served.hub.streams == 0
