"""The benchmark's lean HTTP client against a real HTTP server on loopback (aiohttp's): answers
read whole, connections kept alive and reused, dropped when the server says close or when
idle too long, and what it cannot read refused with a clear error."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import uvloop
from aiohttp import web

from sim.http_client import IDLE_S, HttpError, LeanHttp
from tests.support.ports import free_port


class Server:
    def __init__(self) -> None:
        self.peers: list[object] = []
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []


@contextlib.asynccontextmanager
async def server() -> AsyncIterator[tuple[Server, int]]:
    seen = Server()

    async def echo(request: web.Request) -> web.Response:
        seen.peers.append(
            request.transport.get_extra_info("peername") if request.transport else None
        )
        seen.bodies.append(await request.read())
        seen.headers.append(dict(request.headers))
        status = int(request.query.get("status", "201"))
        answer = web.Response(status=status, body=b'{"ok":' + str(len(seen.bodies)).encode() + b"}")
        if "close" in request.query:
            answer.force_close()
        return answer

    async def chunked(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse()
        answer.enable_chunked_encoding()
        await answer.prepare(request)
        await answer.write(b"part")
        await answer.write_eof()
        return answer

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/chunked", chunked)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield seen, port
    finally:
        await runner.cleanup()


def test_it_works_on_uvloop_as_the_benchmark_runs_it() -> None:
    async def scenario() -> list[tuple[int, bytes]]:
        async with server() as (_, port):
            http = LeanHttp("127.0.0.1", port, headers={}, limit=2)
            try:
                return list(await asyncio.gather(*(http.post("/echo", b"{}") for _ in range(4))))
            finally:
                await http.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        answers = runner.run(scenario())
    assert sorted(status for status, _ in answers) == [201] * 4


async def test_answers_are_read_whole_on_one_kept_alive_connection() -> None:
    async with server() as (seen, port):
        http = LeanHttp("127.0.0.1", port, headers={"Authorization": "Bearer t"}, limit=1)
        try:
            answers = [await http.post("/echo", f'{{"n":{n}}}'.encode()) for n in range(3)]
        finally:
            await http.close()
    assert answers == [(201, b'{"ok":1}'), (201, b'{"ok":2}'), (201, b'{"ok":3}')]
    assert seen.bodies == [b'{"n":0}', b'{"n":1}', b'{"n":2}']
    assert {h["Authorization"] for h in seen.headers} == {"Bearer t"}
    assert {h["Content-Type"] for h in seen.headers} == {"application/json"}
    assert len(set(seen.peers)) == 1, "one connection, kept alive"


async def test_concurrent_requests_never_exceed_the_limit_of_connections() -> None:
    async with server() as (seen, port):
        http = LeanHttp("127.0.0.1", port, headers={}, limit=4)
        try:
            answers = await asyncio.gather(
                *(http.post("/echo?status=200", b"{}") for _ in range(40))
            )
        finally:
            await http.close()
    assert sorted(status for status, _ in answers) == [200] * 40
    assert 1 <= len(set(seen.peers)) <= 4


async def test_a_connection_the_server_closes_or_left_idle_is_not_reused() -> None:
    async with server() as (seen, port):
        http = LeanHttp("127.0.0.1", port, headers={}, limit=1)
        try:
            assert (await http.post("/echo?close=1", b"{}"))[0] == 201
            assert (await http.post("/echo", b"{}"))[0] == 201
            # Idle for longer than IDLE_S (its last use moved back rather than waited for).
            for connection in http._idle:
                connection.used_at -= IDLE_S + 1
            assert (await http.post("/echo", b"{}"))[0] == 201
        finally:
            await http.close()
    assert len(set(seen.peers)) == 3


async def test_an_error_status_is_returned_and_an_unreadable_answer_is_refused() -> None:
    async with server() as (_, port):
        http = LeanHttp("127.0.0.1", port, headers={}, limit=1)
        try:
            assert await http.post("/echo?status=422", b"{}") == (422, b'{"ok":1}')
            with pytest.raises(HttpError, match="chunked"):
                await http.post("/chunked", b"{}")
            # The connection that gave it is gone; the next request works on a new one.
            assert (await http.post("/echo", b"{}"))[0] == 201
        finally:
            await http.close()
