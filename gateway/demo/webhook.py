"""The demo's own webhook receiver: a small HTTP server on loopback that the demo's
``[[notify.receivers]]`` points at, so notifications have somewhere to go and the console's
Notifications page shows them delivered.

It answers every ``POST`` with ``204 No Content`` and keeps the ``X-Gateway-Event-Id`` of each
(the gateway's deliveries are at least once: a receiver deduplicates on that header). Only what
the gateway's webhook client sends is understood: a request line, headers, a body of
``Content-Length`` bytes; anything else is answered ``400`` and the connection closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Final, Self

MAX_HEADER_BYTES: Final = 16 * 1024
MAX_BODY_BYTES: Final = 1024 * 1024
READ_TIMEOUT_S: Final = 10.0


class WebhookReceiver:
    """Listens on ``host``, on a free port, for the lifetime of ``async with``."""

    def __init__(self, host: str = "127.0.0.1", path: str = "/notifications") -> None:
        self.host = host
        self.path = path
        self.port = 0
        self.event_ids: list[str] = []
        """The ``X-Gateway-Event-Id`` of each POST received, in order (repeats included)."""
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.path}"

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            for writer in list(self._connections):  # the gateway client's keep-alive ones
                writer.close()
            await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            while await self._one_request(reader, writer):
                pass
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; whether the connection stays open for another."""
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            return False  # the client closed an idle connection
        except asyncio.LimitOverrunError:
            await _answer(writer, 400, close=True)
            return False
        if len(head) > MAX_HEADER_BYTES:
            await _answer(writer, 400, close=True)
            return False
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method = request_line.partition(" ")[0]
        headers = {}
        for line in header_lines:
            name, colon, value = line.partition(":")
            if colon:
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        if method != "POST" or not 0 <= length <= MAX_BODY_BYTES:
            await _answer(writer, 400, close=True)
            return False
        async with asyncio.timeout(READ_TIMEOUT_S):
            await reader.readexactly(length)
        self.event_ids.append(headers.get("x-gateway-event-id", ""))
        close = headers.get("connection", "").lower() == "close"
        await _answer(writer, 204, close=close)
        return not close


async def _answer(writer: asyncio.StreamWriter, status: int, *, close: bool) -> None:
    reason = {204: "No Content", 400: "Bad Request"}[status]
    connection = "close" if close else "keep-alive"
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\nConnection: {connection}\r\n\r\n"
    writer.write(head.encode())
    await writer.drain()
