"""A scripted OpenAI-compatible chat-completions server on loopback, for tests.

``async with FakeLlm() as llm:`` serves ``POST /v1/chat/completions`` on 127.0.0.1 at a port the
kernel picks; point a client at ``llm.base_url``. Answers come from a FIFO script
(``reply``/``reply_raw``), falling back to a valid summary JSON when the script is empty.
``hang``, ``hold``/``release``, ``delay`` and ``reject_response_format_once`` stage the failure
modes of real servers.
Every hung or delayed handler is released when the server stops, so stopping never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from aiohttp import web

DEFAULT_SUMMARY: dict[str, object] = {
    "summary": "Door open at the hall",
    "possible_cause": "Someone left it open",
    "inspection_suggestion": "Check the hall door",
    "risk_level": "MEDIUM",
    "confidence": 0.7,
}
DEFAULT_CONTENT = json.dumps(DEFAULT_SUMMARY)


@dataclass(frozen=True)
class _Scripted:
    body: str
    status: int
    content_type: str
    headers: dict[str, str] | None = None


class FakeLlm:
    def __init__(self) -> None:
        self.base_url = ""
        self.port = 0
        #: JSON bodies received, in arrival order (including rejected and hung ones).
        self.requests: list[dict[str, Any]] = []
        #: Headers of those requests, index for index.
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self._script: deque[_Scripted] = deque()
        self._hangs = 0
        self._holds = 0
        self._released: asyncio.Event | None = None
        self._delay_s = 0.0
        self._reject_response_format = False
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None
        self._arrived: asyncio.Condition | None = None

    # --- scripting -------------------------------------------------------------------------

    def reply(self, content: str, *, status: int = 200, model: str = "fake-model") -> None:
        """Queue an answer. A 2xx wraps ``content`` as the assistant message of a
        chat-completions response; any other status sends ``content`` as the body verbatim."""
        if 200 <= status < 300:
            self.reply_raw(json.dumps(self.completion(content, model=model)), status=status)
        else:
            self.reply_raw(content, status=status)

    def reply_raw(
        self,
        body: str,
        *,
        status: int = 200,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        """Queue an answer whose body is sent exactly as given (malformed responses), with
        ``headers`` besides (a redirect's ``Location``)."""
        self._script.append(_Scripted(body, status, content_type, headers))

    def hang(self) -> None:
        """The next request gets no answer until the server stops (each call adds one)."""
        self._hangs += 1

    def hold(self) -> None:
        """The next request waits for :meth:`release` (or the stop) before it is answered."""
        self._holds += 1

    def release(self) -> None:
        """Answer the held requests now (as scripted)."""
        if self._released is not None:
            self._released.set()

    def delay(self, seconds: float) -> None:
        """Every answer from now on waits ``seconds`` first (a slow model); 0 resets."""
        self._delay_s = seconds

    def reject_response_format_once(self) -> None:
        """The next request carrying ``response_format`` gets the 400 an older server sends."""
        self._reject_response_format = True

    def completion(self, content: str, *, model: str = "fake-model") -> dict[str, object]:
        return {
            "id": f"chatcmpl-fake-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 42, "completion_tokens": 42, "total_tokens": 84},
        }

    async def wait_for_requests(self, count: int, *, within_s: float = 10.0) -> None:
        """Return once ``count`` requests have arrived in total."""
        assert self._arrived is not None, "FakeLlm is not running"
        arrived = self._arrived
        async with asyncio.timeout(within_s), arrived:
            await arrived.wait_for(lambda: len(self.requests) >= count)

    # --- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._stopping = asyncio.Event()
        self._arrived = asyncio.Condition()
        self._released = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        # Handlers are released on stop; the timeout only bounds a handler stuck elsewhere.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._stopping is not None:
            self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- serving ---------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._stopping is not None
        assert self._arrived is not None
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            try:
                body = await request.json()
            except ValueError:
                return _error(400, "request body is not JSON")
            async with self._arrived:
                self.requests.append(body)
                self.headers.append(dict(request.headers))
                self._arrived.notify_all()

            if self._hangs:
                self._hangs -= 1
                await self._stopping.wait()
                return _error(503, "fake LLM stopped")
            if self._holds:
                self._holds -= 1
                assert self._released is not None
                released = asyncio.create_task(self._released.wait())
                stopping = asyncio.create_task(self._stopping.wait())
                await asyncio.wait({released, stopping}, return_when=asyncio.FIRST_COMPLETED)
                released.cancel()
                stopping.cancel()
            if self._reject_response_format and "response_format" in body:
                self._reject_response_format = False
                return _error(400, "response_format not supported")
            scripted = self._script.popleft() if self._script else None
            if self._delay_s > 0:
                # A slow model, not a synchronisation wait; stopping cuts it short.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._delay_s):
                        await self._stopping.wait()
            if scripted is None:
                model = body.get("model") if isinstance(body.get("model"), str) else "fake-model"
                return web.json_response(self.completion(DEFAULT_CONTENT, model=model))
            return web.Response(
                text=scripted.body,
                status=scripted.status,
                content_type=scripted.content_type,
                headers=scripted.headers,
            )
        finally:
            self.in_flight -= 1


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error"}}, status=status
    )
