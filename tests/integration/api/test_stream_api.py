"""The live stream over real HTTP against real PostgreSQL: exact order across transactions
that commit out of id order, resume from any cursor with no gap and no duplicate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from gateway.config import TokenConfig
from storage import console, outbox
from tests.support.api_client import ADMIN, VIEWER
from tests.support.api_server import Served, serve_api
from tests.support.sse import open_stream
from tests.support.waiting import wait_until

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]


@pytest.fixture
async def served(db_dsn: str) -> AsyncIterator[Served]:
    async with serve_api(db_dsn, TOKENS) as served:
        yield served


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _event(conn: asyncpg.Connection, name: str) -> None:
    await outbox.add_event(
        conn, aggregate_type="test", aggregate_id=name, event_type=f"test.{name}",
        payload={"name": name},
    )  # fmt: skip


async def test_a_late_commit_is_delivered_in_order_and_resumes_exactly(
    served: Served, http: aiohttp.ClientSession, db: asyncpg.Connection, db_dsn: str
) -> None:
    start = str(await console.stream_tail(db))
    early = await asyncpg.connect(db_dsn)
    try:
        async with open_stream(http, served.base, token=VIEWER, last_event_id=start) as stream:
            await stream.live()
            # "early" writes its event first and stays open; "late" writes and commits.
            held = early.transaction()
            await held.start()
            await _event(early, "early")
            await _event(db, "late")
            # A pass of the hub now sees "late" committed, and must hold it back: an
            # "id > last seen" stream would send it and then never send "early".
            assert await served.hub.run_once() == 0
            await held.commit()
            got = await stream.take(2)
        assert [e.data["aggregate_id"] for e in got] == ["early", "late"]
        assert [e.event for e in got] == ["test.early", "test.late"]
        assert got[0].data["payload"] == {"name": "early"}
        assert set(got[0].data) == {
            "event_id", "event_type", "aggregate_type", "aggregate_id", "payload", "created_at",
        }  # fmt: skip
        assert got[0].id is not None
        assert got[1].id is not None

        # Resume from every cursor, by header and by query: what followed it, once, in
        # order (from the table), then what comes next (the live fan-out), no duplicate.
        seen = list(got)
        for n in range(6):
            cursor = start if n == 0 else seen[n - 1].id
            by_header = n % 2 == 0
            async with open_stream(
                http, served.base, token=VIEWER,
                last_event_id=cursor if by_header else None,
                query_cursor=None if by_header else cursor,
            ) as stream:  # fmt: skip
                rest = await stream.take(len(seen) - n)
                assert [e.id for e in rest] == [e.id for e in seen[n:]], n
                await stream.live()
                await _event(db, f"marker-{n}")
                following = await stream.next()
                assert following.data["aggregate_id"] == f"marker-{n}"
            seen.append(following)
    finally:
        await early.close()


async def test_streams_started_from_a_ticket_see_every_event_once(
    served: Served, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    """Two streams, many transactions racing: each stream gets every event, once, in the
    same order."""
    async with http.post(
        f"{served.base}/stream/tickets", headers={"Authorization": f"Bearer {VIEWER}"}
    ) as reply:
        ticket = (await reply.json())["ticket"]
    pool = served.alarms.pool
    async with (
        open_stream(http, served.base, ticket=ticket) as first,
        open_stream(http, served.base, token=ADMIN) as second,
    ):
        await first.live()
        await second.live()

        async def write(n: int) -> None:
            async with pool.acquire() as conn, conn.transaction():
                await _event(conn, f"n{n}")

        await asyncio.gather(*(write(n) for n in range(60)))
        a = await first.take(60)
        b = await second.take(60)
    assert sorted(e.data["aggregate_id"] for e in a) == sorted(f"n{n}" for n in range(60))
    assert [e.id for e in a] == [e.id for e in b]
    assert len({e.id for e in a}) == 60


async def test_a_client_that_goes_away_leaves_the_fan_out(
    served: Served, http: aiohttp.ClientSession
) -> None:
    async with open_stream(http, served.base, token=VIEWER) as first:
        await first.live()
        async with open_stream(http, served.base, token=VIEWER) as second:
            await second.live()
            assert served.hub.streams == 2
        await wait_until(lambda: served.hub.streams == 1, message="the closed stream left")
    await wait_until(lambda: served.hub.streams == 0, message="both streams left")
