"""A lean HTTP/1.1 client for the benchmark's command phase: keep-alive connections, one
request at a time on each, answers framed by ``Content-Length``.

Written by hand, like the responder's transport, because the load generator shares the two
cores it measures: aiohttp's client spent most of a core on 1,000 requests a second, CPU the
gateway and PostgreSQL then lacked. This one does what that phase needs and nothing more: no
redirects, cookies, compression, TLS or chunked answers (the gateway frames every answer with
``Content-Length``; anything else is an error, not a guess).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Final, cast

# Idle connections are dropped before the gateway's HTTP server drops them (uvicorn closes an
# idle keep-alive connection after 5 s): a request sent on a connection the server is closing at
# that instant would be reset, and a POST is not retried.
IDLE_S: Final = 2.0
HEAD_END: Final = b"\r\n\r\n"


class HttpError(Exception):
    """The connection broke or the answer was not one this client reads."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.keep_alive = True
        self.used_at = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no subclasses of asyncio.Transport, but they are ones.
        self.transport = cast("asyncio.Transport", transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(HttpError(f"connection lost: {exc!r}"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is None or self.waiter.done():
            return
        head_end = self.buffer.find(HEAD_END)
        if head_end < 0:
            return
        try:
            status, length = self._head(bytes(self.buffer[:head_end]))
        except HttpError as exc:
            self.waiter.set_exception(exc)
            return
        end = head_end + len(HEAD_END) + length
        if len(self.buffer) < end:
            return
        body = bytes(self.buffer[head_end + len(HEAD_END) : end])
        del self.buffer[:end]
        self.waiter.set_result((status, body))

    def _head(self, head: bytes) -> tuple[int, int]:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value.strip())
            elif name == b"connection" and value.strip().lower() == b"close":
                self.keep_alive = False
            elif name == b"transfer-encoding":
                raise HttpError("a chunked answer: this client reads Content-Length only")
        if length is None:
            raise HttpError("an answer without Content-Length")
        return int(parts[1]), length

    async def request(self, data: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        try:
            return await self.waiter
        finally:
            self.waiter = None
            self.used_at = time.monotonic()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class LeanHttp:
    """``await post(path, body)`` → (status, body), at most ``limit`` requests at once, each on
    a kept-alive connection of its own."""

    def __init__(self, host: str, port: int, *, headers: dict[str, str], limit: int) -> None:
        self.host = host
        self.port = port
        self._head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._slots = asyncio.Semaphore(limit)
        self._idle: deque[_Connection] = deque()
        self._all: set[_Connection] = set()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        data = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._head}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        async with self._slots:
            connection = await self._connection()
            try:
                answer = await connection.request(data)
            except BaseException:
                connection.close()
                self._all.discard(connection)
                raise
            if connection.keep_alive and not connection.closed:
                self._idle.append(connection)
            else:
                connection.close()
                self._all.discard(connection)
            return answer

    async def _connection(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()  # the most recently used: least likely to be closing
            if not connection.closed and now - connection.used_at < IDLE_S:
                return connection
            connection.close()
            self._all.discard(connection)
        _, connection = await asyncio.get_running_loop().create_connection(
            _Connection, self.host, self.port
        )
        self._all.add(connection)
        return connection

    async def close(self) -> None:
        for connection in self._all:
            connection.close()
        self._all.clear()
        self._idle.clear()
