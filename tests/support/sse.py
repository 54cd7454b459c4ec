"""A Server-Sent Events reader for the stream tests: real HTTP (aiohttp), the wire format
parsed as EventSource parses it (``id``, ``event``, ``data`` lines; comments; blank line ends an
event)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Sse:
    id: str | None
    event: str | None
    data: Any  # decoded JSON


@dataclass
class SseStream:
    response: aiohttp.ClientResponse
    comments: list[str] = field(default_factory=list)

    async def next(self, timeout: float = 30.0) -> Sse:  # noqa: ASYNC109 - a deadline per event
        """The next event (comments are collected on the side)."""
        async with asyncio.timeout(timeout):
            fields: dict[str, str] = {}
            data: list[str] = []
            while True:
                raw = await self.response.content.readline()
                if not raw:
                    raise EOFError("the stream ended")
                line = raw.decode().rstrip("\r\n")
                if not line:
                    if data:
                        return Sse(
                            fields.get("id"), fields.get("event"), json.loads("\n".join(data))
                        )
                    continue
                if line.startswith(":"):
                    self.comments.append(line[1:].strip())
                    continue
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "data":
                    data.append(value)
                else:
                    fields[name] = value

    async def live(self, timeout: float = 30.0) -> None:  # noqa: ASYNC109 - a deadline
        """Wait for the server's first comment: the stream is registered, nothing after this
        point can be missed."""
        async with asyncio.timeout(timeout):
            while not self.comments:
                raw = await self.response.content.readline()
                if not raw:
                    raise EOFError("the stream ended")
                line = raw.decode().rstrip("\r\n")
                if line.startswith(":"):
                    self.comments.append(line[1:].strip())
                elif line:
                    raise AssertionError(f"an event before the first comment: {line!r}")

    async def take(self, n: int, timeout: float = 30.0) -> list[Sse]:  # noqa: ASYNC109 - per event
        return [await self.next(timeout) for _ in range(n)]

    async def ended(self, timeout: float = 30.0) -> bool:  # noqa: ASYNC109 - a deadline
        """Whether the server ends the stream (reads until EOF, skipping events)."""
        with contextlib.suppress(aiohttp.ClientPayloadError):
            async with asyncio.timeout(timeout):
                while await self.response.content.readline():
                    pass
        return True


@contextlib.asynccontextmanager
async def open_stream(
    http: aiohttp.ClientSession,
    base: str,
    *,
    token: str | None = None,
    ticket: str | None = None,
    last_event_id: str | None = None,
    query_cursor: str | None = None,
) -> AsyncIterator[SseStream]:
    headers = {"Accept": "text/event-stream"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    params = {}
    if ticket is not None:
        params["ticket"] = ticket
    if query_cursor is not None:
        params["last_event_id"] = query_cursor
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with http.get(f"{base}/stream", headers=headers, params=params, timeout=timeout) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        yield SseStream(resp)
