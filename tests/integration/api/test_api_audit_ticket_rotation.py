"""A stream ticket names the token that asked for it, not only its name and role: a reload that
rotates the token (same name, same role, a new secret) voids the tickets the old one got, as
api.md and the ticket route promise ("a reload that removes or rotates the token voids it").
Rotation is what an operator does when a token leaked: a ticket the leaked token got just
before must not open a stream after."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.config import TokenConfig
from tests.support.api_client import ADMIN, OPERATOR, VIEWER
from tests.support.api_server import Served, serve_api

ROTATED = "operator-token-rotated-0123456789"
BEFORE = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]
AFTER = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=ROTATED, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]


@pytest.fixture
async def served(db_dsn: str) -> AsyncIterator[Served]:
    async with serve_api(db_dsn, BEFORE) as served:
        yield served


async def _ticket(http: aiohttp.ClientSession, base: str, token: str) -> str:
    async with http.post(
        f"{base}/stream/tickets", headers={"Authorization": f"Bearer {token}"}
    ) as reply:
        assert reply.status == 201, await reply.text()
        ticket: str = (await reply.json())["ticket"]
        return ticket


async def _stream_status(http: aiohttp.ClientSession, base: str, ticket: str) -> int:
    timeout = aiohttp.ClientTimeout(total=30)
    async with http.get(f"{base}/stream?ticket={ticket}", timeout=timeout) as response:
        return response.status


async def test_a_rotated_tokens_tickets_are_refused(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        old = await _ticket(http, served.base, OPERATOR)
        kept = await _ticket(http, served.base, VIEWER)
        served.auth.replace(AFTER)  # SIGHUP: `console` rotated, `wall-screen` as it was
        assert await _stream_status(http, served.base, old) == 401
        # The tokens the reload left alone keep their tickets; the new secret gets its own.
        assert await _stream_status(http, served.base, kept) == 200
        new = await _ticket(http, served.base, ROTATED)
        assert await _stream_status(http, served.base, new) == 200


async def test_a_ticket_is_refused_once_its_token_changes_role(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        old = await _ticket(http, served.base, OPERATOR)
        served.auth.replace([TokenConfig(token=OPERATOR, role="viewer", name="console"), BEFORE[2]])
        assert await _stream_status(http, served.base, old) == 401
