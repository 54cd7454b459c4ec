"""The ASGI server inside the daemon's event loop: uvicorn, without its signal handlers.

``async with ApiServer(app, host, port)``: listening inside (``port`` is the real one, also
when 0 asked for an ephemeral port), closed after. uvicorn's ``serve()`` would install its own
SIGINT/SIGTERM handlers (and re-raise them on exit); the daemon owns the signals, so this drives
uvicorn's steps itself: ``startup`` on a socket bound here, ``main_loop`` as a task (it keeps
the ``Date`` header fresh and watches ``should_exit``), ``shutdown`` on exit.

HEAD is answered as GET without the body (RFC 9110 §9.3.2: a general-purpose server MUST
support it; monitors probe ``/health`` with it): uvicorn sends no body for a HEAD request, so
the app is handed a GET, except on the paths the app lists under ``STATE_NO_HEAD`` (an answer
that never ends: the live stream), where HEAD stays a method the path does not serve.

uvicorn logs through the standard library; a filter keeps tracebacks out of its records (the
app answers every exception itself; what would reach uvicorn is a failure to send, and its
traceback could quote a request's headers), and access logs are off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import Any, Final, cast

import uvicorn
from litestar import Litestar
from litestar.types import ASGIApp, Receive, Scope, Send

GRACEFUL_SHUTDOWN_S: Final = 5.0
# Where the app finds the server (``app.state``): to cut a connection (see ApiServer.abort).
STATE_SERVER: Final = "server"
# The paths whose GET never ends (a frozenset in ``app.state``): HEAD is not answered as GET.
STATE_NO_HEAD: Final = "no_head"
_LINGER_OFF: Final = struct.pack("ii", 1, 0)
_UVICORN_LOGGERS: Final = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


class _NoTracebacks(logging.Filter):
    """A record's exception as its type alone: never the message, never the frames."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(exc).__name__})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


_FILTER: Final = _NoTracebacks()


def _quiet_uvicorn() -> None:
    for name in _UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def head_as_get(app: ASGIApp, no_head: frozenset[str]) -> ASGIApp:
    """``app`` answering HEAD as GET on every path but ``no_head``. The server keeps its own
    scope, still HEAD, and sends the answer's status and headers without its body."""

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        raw = cast(dict[str, Any], scope)
        if raw["type"] == "http" and raw["method"] == "HEAD" and raw["path"] not in no_head:
            scope = cast(Scope, {**raw, "method": "GET"})
        await app(scope, receive, send)

    return serve


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class ApiServer:
    def __init__(self, app: Litestar, host: str, port: int) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._socket: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._loop_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ApiServer:
        _quiet_uvicorn()
        config = uvicorn.Config(
            head_as_get(self.app, self.app.state.get(STATE_NO_HEAD, frozenset())),
            lifespan="off",
            http="httptools",
            loop="none",
            log_config=None,
            access_log=False,
            server_header=False,
            proxy_headers=False,
            timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S),
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        self._socket = _bind(self.host, self.port)
        # With port 0 the kernel picked one: report the real address.
        self.port = int(self._socket.getsockname()[1])
        await server.startup(sockets=[self._socket])
        self._server = server
        self._loop_task = asyncio.create_task(server.main_loop(), name="http-server")
        self.app.state[STATE_SERVER] = self
        return self

    def abort(self, client: tuple[str, int] | None) -> bool:
        """Reset the connection of ``client`` (the ASGI scope's ``client``) at once; whether
        one was found. ASGI has no such call, and closing is not enough: a closed transport
        still waits to flush what it holds, and so does the kernel with a closed socket, which
        a peer that stopped reading never lets them, so the buffers stay taken. The stream hub
        cuts its stalled readers with this."""
        server = self._server
        if server is None or client is None:
            return False
        for connection in list(server.server_state.connections):
            if getattr(connection, "client", None) == tuple(client):
                transport = getattr(connection, "transport", None)
                # Closing already (the app ended the answer) is no matter: abort drops the rest.
                if isinstance(transport, asyncio.Transport):
                    sock = transport.get_extra_info("socket")
                    # Linger 0: the kernel drops what is unsent and answers RST. A plain close
                    # would keep the socket, orphaned, trying to send its buffers. (A socket
                    # closed meanwhile refuses the option: the abort is then moot anyway.)
                    with contextlib.suppress(OSError):
                        if sock is not None:
                            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_OFF)
                    transport.abort()
                    return True
        return False

    def connected(self, client: tuple[str, int] | None) -> bool:
        """Whether the connection of ``client`` still stands: open, its transport neither lost
        nor closing. A chunk of an answer handed to the server while it stood went to the
        transport; for a connection already lost the server drops it without a word (the
        stream hub asks this before it counts a written event as reaching someone)."""
        server = self._server
        if server is None or client is None:
            return False
        for connection in list(server.server_state.connections):
            if getattr(connection, "client", None) == tuple(client):
                transport = getattr(connection, "transport", None)
                return isinstance(transport, asyncio.Transport) and not transport.is_closing()
        return False

    async def __aexit__(self, *exc_info: object) -> None:
        server, task = self._server, self._loop_task
        if server is None or task is None:
            return
        server.should_exit = True
        await task
        await server.shutdown(sockets=[self._socket] if self._socket is not None else None)
