"""Real local notification receivers: an aiohttp web server and an aiosmtpd SMTP server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from email import message_from_bytes, policy
from email.message import EmailMessage
from typing import Any

import msgspec
from aiohttp import web
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult

from tests.support.ports import free_port


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return msgspec.json.decode(self.body)

    @property
    def event_id(self) -> str:
        return self.headers["X-Gateway-Event-Id"]


# What the server answers to the n-th request (0-based) on a path: a status, or None to hang
# until `release` is set (then 200).
Behaviour = Callable[[int, "Received"], int | None]


def always(status: int) -> Behaviour:
    return lambda _n, _r: status


# What the server answers with, status given, when the default ("ok" / "nope") will not do.
Answer = Callable[[web.Request, "Received", int], Awaitable[web.StreamResponse]]


def streamed(size: int, chunk: int = 64 * 1024) -> Answer:
    """A body of ``size`` bytes, written a chunk at a time: never held whole, by either side
    unless the client keeps it. A client that hangs up ends it."""
    block = b"x" * chunk

    async def answer(request: web.Request, _got: Received, status: int) -> web.StreamResponse:
        response = web.StreamResponse(status=status)
        response.content_length = size
        await response.prepare(request)
        left = size
        with contextlib.suppress(ConnectionError):
            while left > 0:
                await response.write(block if left >= chunk else block[:left])
                left -= chunk
        return response

    return answer


def echoing() -> Answer:
    """The request's headers echoed back, one per line, as some servers' error pages do."""

    async def answer(_request: web.Request, got: Received, status: int) -> web.StreamResponse:
        text = "".join(f"{name}: {value}\n" for name, value in got.headers.items())
        return web.Response(status=status, text=f"you sent\n{text}")

    return answer


@dataclass
class WebhookServer:
    """Records every request; answers each path as its behaviour says."""

    behaviours: dict[str, Behaviour] = field(default_factory=dict)
    answers: dict[str, Answer] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: dict[str, int] = field(default_factory=dict)
    peak_in_flight: dict[str, int] = field(default_factory=dict)
    port: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def on(self, path: str) -> list[Received]:
        return [r for r in self.received if r.path == path]

    async def handle(self, request: web.Request) -> web.Response:
        got = Received(path=request.path, headers=dict(request.headers), body=await request.read())
        n = len(self.on(request.path))
        self.received.append(got)
        behaviour = self.behaviours.get(request.path, always(200))
        status = behaviour(n, got)
        path = request.path
        self.in_flight[path] = self.in_flight.get(path, 0) + 1
        self.peak_in_flight[path] = max(self.peak_in_flight.get(path, 0), self.in_flight[path])
        self.changed.set()
        try:
            if status is None:
                await self.release.wait()
                status = 200
            answer = self.answers.get(path)
            if answer is not None:
                return await answer(request, got, status)
            return web.Response(status=status, text="ok" if status < 300 else "nope")
        finally:
            self.in_flight[path] -= 1
            self.changed.set()


@contextlib.asynccontextmanager
async def webhook_server(**behaviours: Behaviour) -> AsyncIterator[WebhookServer]:
    """``webhook_server(a=always(500))`` serves ``/a`` so; other paths answer 200."""
    server = WebhookServer(behaviours={f"/{k}": v for k, v in behaviours.items()})
    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    server.port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", server.port)
    await site.start()
    try:
        yield server
    finally:
        server.release.set()
        await runner.cleanup()


@dataclass
class Mail:
    mail_from: str
    rcpt_tos: list[str]
    message: EmailMessage


class _Handler:
    def __init__(self) -> None:
        self.mails: list[Mail] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        message = message_from_bytes(envelope.content, policy=policy.default)
        assert isinstance(message, EmailMessage)
        self.mails.append(Mail(envelope.mail_from, list(envelope.rcpt_tos), message))
        return "250 OK"


class _StallingQuit(_Handler):
    """Takes the mail (250 to its DATA), then never answers QUIT: counts the QUITs it got and
    the clients that hung up on one."""

    def __init__(self) -> None:
        super().__init__()
        self.quits = 0
        self.hung_up = 0

    async def handle_QUIT(self, server: Any, session: Any, envelope: Any) -> str:
        self.quits += 1
        try:
            await asyncio.Event().wait()  # until the client hangs up (or the server stops)
        except asyncio.CancelledError:
            self.hung_up += 1
            raise
        return "221 Bye"


class Logins:
    """An aiosmtpd authenticator accepting one login and password; what was tried, in order."""

    def __init__(self, login: str, password: str) -> None:
        self.expected = (login.encode(), password.encode())
        self.tried: list[tuple[str, str]] = []

    def __call__(
        self, server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any
    ) -> AuthResult:
        given = (bytes(auth_data.login), bytes(auth_data.password))
        self.tried.append((given[0].decode(), mechanism))
        return AuthResult(success=given == self.expected)


@contextlib.contextmanager
def smtp_server(*, stall_quit: bool = False, **smtp: Any) -> Any:
    """A real SMTP server (aiosmtpd) on loopback; ``.handler.mails`` collects what it got.
    ``smtp`` goes to the server: ``tls_context`` and ``require_starttls`` for STARTTLS,
    ``authenticator`` for AUTH, or ``ssl_context`` for implicit TLS. ``stall_quit``: it never
    answers QUIT (``.handler.quits``, ``.handler.hung_up``)."""
    handler = _StallingQuit() if stall_quit else _Handler()
    controller = Controller(handler, hostname="127.0.0.1", port=free_port(), **smtp)
    controller.start()
    try:
        yield controller
    finally:
        controller.stop()
