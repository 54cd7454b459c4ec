"""The live stream over real HTTP against real PostgreSQL: exact order across transactions
that commit out of id order, resume from any cursor with no gap and no duplicate."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import msgspec
import pytest

from gateway.api import stream as stream_module
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


async def _refused(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """A refused stream's status, error body and headers (an accepted one never ends: fail)."""
    async with http.get(url, headers=headers) as reply:
        assert reply.status != 200, f"{url} was accepted"
        return reply.status, await reply.json(), dict(reply.headers)


async def test_streams_are_limited_per_token_and_per_node(
    served: Served, http: aiohttp.ClientSession
) -> None:
    served.hub.max_streams = 3
    served.hub.max_streams_per_token = 2
    url = f"{served.base}/stream"
    viewer = {"Authorization": f"Bearer {VIEWER}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with open_stream(http, served.base, token=VIEWER) as first:
        await first.live()
        async with open_stream(http, served.base, token=VIEWER) as second:
            await second.live()
            status, body, headers = await _refused(http, url, viewer)
            assert (status, body["error"]) == (429, "TOO_MANY_STREAMS")
            assert "Retry-After" in headers
            async with open_stream(http, served.base, token=ADMIN) as third:
                await third.live()  # another token's: within its own limit and the node's
                status, body, headers = await _refused(http, url, admin)
                assert (status, body["error"]) == (503, "STREAMS_FULL")
                assert "Retry-After" in headers
        # One closed: the token may open one again.
        await wait_until(lambda: served.hub.streams == 1, message="two streams left")
        async with open_stream(http, served.base, token=VIEWER) as again:
            await again.live()
    await wait_until(lambda: served.hub.streams == 0, message="every stream left")


TCP_CLOSE = 7  # linux/tcp_states.h: what a reset leaves
TCP_CLOSE_WAIT = 8  # the peer sent FIN


def _tcp_state(sock: socket.socket) -> int:
    """The connection's state as the kernel has it (Linux ``TCP_INFO``'s first byte)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


async def test_a_reader_that_never_reads_is_cut_once_its_socket_is_full(
    served: Served, db: asyncpg.Connection
) -> None:
    """A client that sends its request and never reads: once the kernel's buffers are full,
    the server's write waits; past the write deadline the connection is reset (not merely
    closed, which would wait to flush forever) and the stream leaves the hub."""
    served.hub.write_deadline_s = 1.0
    host, port = served.base.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A small receive window: the server's side fills after a few MB instead of many.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, (host, int(port)))
        request = f"GET /stream HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {VIEWER}\r\n\r\n"
        await loop.sock_sendall(sock, request.encode())
        await wait_until(lambda: served.hub.streams == 1, message="the stream is open")
        blob = "x" * 60_000
        written = 0

        async def cut() -> bool:
            # Events until the hub lets go: the reader falls behind by whatever it takes.
            nonlocal written
            if served.hub.streams == 0:
                return True
            async with db.transaction():
                for _ in range(10):
                    await outbox.add_event(
                        db, aggregate_type="test", aggregate_id=f"big-{written}",
                        event_type="test.big", payload={"blob": blob},
                    )  # fmt: skip
                    written += 1
            return False

        await wait_until(cut, timeout=60, interval=0.2, message="the stalled reader is dropped")
        # The server let go of the connection without this side reading a byte: the kernel
        # saw it reset (or closed), not merely the stream left the hub.
        await wait_until(
            lambda: _tcp_state(sock) in {TCP_CLOSE, TCP_CLOSE_WAIT},
            message="the server resets the connection",
        )
    finally:
        sock.close()


async def test_a_ticket_rate_per_token(served: Served, http: aiohttp.ClientSession) -> None:
    async def ticket(token: str) -> tuple[int, dict[str, Any], dict[str, str]]:
        async with http.post(
            f"{served.base}/stream/tickets", headers={"Authorization": f"Bearer {token}"}
        ) as reply:
            return reply.status, await reply.json(), dict(reply.headers)

    granted = [await ticket(VIEWER) for _ in range(stream_module.TICKET_BURST)]
    assert [status for status, _, _ in granted] == [201] * stream_module.TICKET_BURST
    status, body, headers = await ticket(VIEWER)
    assert (status, body["error"]) == (429, "TOO_MANY_TICKETS")
    assert 1 <= int(headers["Retry-After"]) <= stream_module.TICKET_EVERY_S
    status, _, _ = await ticket(ADMIN)  # another token's bucket is its own
    assert status == 201


async def test_a_cursor_past_every_event_is_refused(
    served: Served, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    await _event(db, "one")
    tail = await console.stream_tail(db)
    viewer = {"Authorization": f"Bearer {VIEWER}"}
    url = f"{served.base}/stream"
    horizon = await console.stream_horizon(db)
    # A transaction that has not ended (or not begun), and an id the outbox never gave.
    for header in (f"{horizon + 1000}:1", f"{tail.xid}:{tail.id + 1_000_000}"):
        status, body, _ = await _refused(http, url, {**viewer, "Last-Event-ID": header})
        assert (status, body["error"], body["param"]) == (400, "CURSOR_AHEAD", "Last-Event-ID")
    status, body, _ = await _refused(http, f"{url}?last_event_id={horizon + 1000}:1", viewer)
    assert (status, body["error"], body["param"]) == (400, "CURSOR_AHEAD", "last_event_id")
    # The newest event's own cursor is not ahead: the stream goes live after it.
    async with open_stream(http, served.base, token=VIEWER, last_event_id=str(tail)) as stream:
        await stream.live()


async def test_the_document_describes_the_stream_as_served(
    served: Served, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    """The body is text; each event's `data` is a StreamData with every declared property,
    the first event as every other."""
    async with http.get(f"{served.base}/openapi.json") as reply:
        document = await reply.json()
    (media,) = document["paths"]["/stream"]["get"]["responses"]["200"]["content"].values()
    assert media["schema"] == {"type": "string", "contentMediaType": "text/event-stream"}
    declared = document["components"]["schemas"]["StreamData"]
    start = str(await console.stream_tail(db))
    async with open_stream(http, served.base, token=VIEWER, last_event_id=start) as stream:
        await stream.live()
        await _event(db, "first")
        first = await stream.next()
    assert set(declared["required"]) <= set(first.data)
    assert first.data["aggregate_id"] == "first"
    msgspec.convert(first.data, stream_module.StreamData, strict=False)
