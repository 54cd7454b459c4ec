"""Cut a client's PostgreSQL at a chosen statement: when it is sent, or when it is answered.

A :class:`PgCut` reads the PostgreSQL protocol through a :class:`TcpProxy`, connection by
connection: the statements each client runs (a simple Query, or an extended Execute of the text
its Parse named) and their answers. Armed with a run of consecutive statements on one
connection (a substring or a regex of each text; "answered with rows" where it matters), it
cuts the database away at the last one's chosen moment:

- ``at="sent"``: the statement never reaches the server (its Execute or Query is dropped):
  a write lost with the database, nothing of it done;
- ``at="answered"``: the server ran it, and its answer never reaches the client (dropped from
  its first message on: "the COMMIT's answer lost", the transaction committed or not, the
  client cannot tell).

Then every proxied connection is reset and new ones are refused (accepted and reset at once)
until a client has tried again: :meth:`PgCut.outage` waits for both and lets them in again.
Nothing is timed: the cut falls on a message, the way back on a client's attempt.

Only whole messages pass the proxy (a message split between reads is held until its end
arrives), so the cut falls exactly between two messages. A connection that turns to TLS cannot
be read: ``outage`` fails then (``sslmode=disable`` in the client's DSN).
"""

from __future__ import annotations

import asyncio
import re
import struct
from dataclasses import dataclass, field
from typing import Literal

from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
# A backend message that answers the statement being run (RowDescription only for a simple
# Query: in the extended protocol it answers a Describe, sent before the statement runs).
_ANSWERS = frozenset(b"DCIEsGHW")


@dataclass(frozen=True)
class Statement:
    """One statement of an armed run: ``text`` a substring of the statement's text, or a
    compiled regex searched in it; ``rows``: it must have answered at least one row."""

    text: str | re.Pattern[str]
    rows: bool = False

    def names(self, text: str) -> bool:
        if isinstance(self.text, str):
            return self.text in text
        return self.text.search(text) is not None


@dataclass
class _Run:
    """A statement sent on a connection, and what came of it."""

    text: str
    simple: bool  # a Query message: answered up to its ReadyForQuery
    rows: int = 0
    answered: bool = False
    done: bool = False


@dataclass
class _Sync:
    """A Sync the client sent: the server answers it with a ReadyForQuery."""


@dataclass
class _Trigger:
    steps: tuple[Statement, ...]
    at: Literal["sent", "answered"]


@dataclass
class _Tap:
    """One connection's protocol, both ways; forwards whole messages until the cut."""

    cut: PgCut
    client_buffer: bytearray = field(default_factory=bytearray)
    server_buffer: bytearray = field(default_factory=bytearray)
    # Before the startup message (after an SSLRequest refused: again); None once opaque.
    starting: bool | None = True
    awaiting_ssl_answer: bool = False
    prepared: dict[str, str] = field(default_factory=dict)
    portals: dict[str, str] = field(default_factory=dict)
    waiting: list[_Run | _Sync] = field(default_factory=list)
    history: list[_Run] = field(default_factory=list)

    def from_client(self, data: bytes) -> bytes:
        if self.starting is None:
            return data
        self.client_buffer += data
        out = bytearray()
        while True:
            if self.starting:
                if len(self.client_buffer) < 8:
                    break
                length, code = struct.unpack_from("!ii", self.client_buffer)
                if len(self.client_buffer) < length:
                    break
                message = bytes(self.client_buffer[:length])
                del self.client_buffer[:length]
                out += message
                if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                    self.awaiting_ssl_answer = True
                elif code == _CANCEL_REQUEST:
                    self.starting = None  # not a session: pass what follows as is
                    out += self.client_buffer
                    self.client_buffer.clear()
                    break
                else:
                    self.starting = False
                continue
            if len(self.client_buffer) < 5:
                break
            kind = self.client_buffer[0]
            (length,) = struct.unpack_from("!i", self.client_buffer, 1)
            if len(self.client_buffer) < 1 + length:
                break
            body = bytes(self.client_buffer[5 : 1 + length])
            message = bytes(self.client_buffer[: 1 + length])
            del self.client_buffer[: 1 + length]
            if self._client_message(kind, body):
                return bytes(out)  # cut before this message: it never reaches the server
            out += message
        return bytes(out)

    def from_server(self, data: bytes) -> bytes:
        if self.starting is None:
            return data
        self.server_buffer += data
        out = bytearray()
        while True:
            if self.awaiting_ssl_answer:
                if not self.server_buffer:
                    break
                answer = self.server_buffer[0]
                out.append(answer)
                del self.server_buffer[:1]
                self.awaiting_ssl_answer = False
                if answer != ord("N"):
                    self.starting = None  # encrypted from here: nothing to read in it
                    out += self.server_buffer
                    self.server_buffer.clear()
                    self.cut._opaque()
                    break
                continue
            if len(self.server_buffer) < 5:
                break
            kind = self.server_buffer[0]
            (length,) = struct.unpack_from("!i", self.server_buffer, 1)
            if len(self.server_buffer) < 1 + length:
                break
            message = bytes(self.server_buffer[: 1 + length])
            del self.server_buffer[: 1 + length]
            if self._server_message(kind):
                return bytes(out)  # cut before this answer: it never reaches the client
            out += message
        return bytes(out)

    def _client_message(self, kind: int, body: bytes) -> bool:
        """Reads one frontend message; True when the cut falls before it."""
        if kind == ord("Q"):
            return self._sent(_Run(body.split(b"\0", 1)[0].decode(errors="replace"), True))
        if kind == ord("P"):
            name, query, _ = body.split(b"\0", 2)
            self.prepared[name.decode()] = query.decode(errors="replace")
        elif kind == ord("B"):
            bound, statement, _ = body.split(b"\0", 2)
            self.portals[bound.decode()] = self.prepared.get(statement.decode(), "")
        elif kind == ord("E"):
            executed = body.split(b"\0", 1)[0].decode()
            return self._sent(_Run(self.portals.get(executed, ""), False))
        elif kind == ord("S"):
            self.waiting.append(_Sync())
        return False

    def _sent(self, run: _Run) -> bool:
        self.waiting.append(run)
        self.history = [*self.history[-15:], run]
        return self.cut._check(self.history, "sent")

    def _server_message(self, kind: int) -> bool:
        """Reads one backend message; True when the cut falls before it."""
        head = self.waiting[0] if self.waiting else None
        if not isinstance(head, _Run):
            if kind == ord("Z") and head is not None:
                self.waiting.pop(0)
            return False
        if kind in _ANSWERS or (kind == ord("T") and head.simple):
            if not head.answered:
                head.answered = True
                # Its run: the history up to it (empty when it is too far back to matter).
                run = [*self.history]
                while run and run[-1] is not head:
                    run.pop()
                if run and self.cut._check(run, "answered"):
                    return True
            if kind == ord("D"):
                head.rows += 1
            elif not head.simple and kind in b"CIEs":
                head.done = True
                self.waiting.pop(0)
                if kind == ord("E"):
                    # The server skips what was sent up to the next Sync.
                    while self.waiting and isinstance(skipped := self.waiting[0], _Run):
                        skipped.done = True
                        self.waiting.pop(0)
        elif kind == ord("Z"):
            # Ends a simple Query, or answers a Sync (what was still waiting before it was
            # skipped, after an error).
            while self.waiting:
                item = self.waiting.pop(0)
                if isinstance(item, _Sync):
                    break
                item.done = True
                if item.simple:
                    break
        return False


class PgCut:
    """The database behind ``proxy`` cut away at an armed statement (see the module)."""

    def __init__(self, proxy: TcpProxy) -> None:
        self.proxy = proxy
        self.fired = asyncio.Event()
        self.trigger: _Trigger | None = None
        self.statement: str | None = None  # the text of the statement the cut fell at
        self.opaque = 0  # connections this rig could not read (TLS)
        self._refused_at_cut = 0
        proxy.tap = lambda: _Tap(self)

    def arm(self, *steps: Statement, at: Literal["sent", "answered"]) -> None:
        """Cut once, at the last of ``steps`` run back to back on one connection: when it is
        sent, or when its answer comes (each earlier step answered already)."""
        assert steps
        self.trigger = _Trigger(steps, at)

    async def outage(self, *, timeout: float = 30.0) -> None:  # noqa: ASYNC109 - a deadline
        """Wait for the armed cut to fall, then keep the database away until a client has
        tried to reach it again (and been refused), then let clients in again."""

        def fired() -> bool:
            assert not self.opaque, "a connection to the database is encrypted: use sslmode"
            return self.fired.is_set()

        await wait_until(fired, timeout=timeout, message="the armed statement ran")
        await wait_until(
            lambda: self.proxy.connections == 0,
            timeout=timeout,
            message="every connection reset",
        )
        await wait_until(
            lambda: self.proxy.refused > self._refused_at_cut,
            timeout=timeout,
            message="a client tried the database again",
        )
        self.proxy.refusing = False
        self.proxy.swallowing = False

    def _check(self, history: list[_Run], at: str) -> bool:
        trigger = self.trigger
        if trigger is None or trigger.at != at or self.fired.is_set():
            return False
        steps = trigger.steps
        if len(history) < len(steps):
            return False
        runs = history[-len(steps) :]
        *earlier, last = zip(steps, runs, strict=True)
        if not last[0].names(last[1].text):
            return False
        for step, run in earlier:
            if not step.names(run.text) or not run.done:
                return False
            if step.rows and run.rows == 0:
                return False
        self._fire(last[1].text)
        return True

    def _fire(self, text: str) -> None:
        self.statement = text
        self.fired.set()
        # From here nothing passes, either way, on any connection; the resets follow once
        # the callback reading this message has returned (what it forwarded before goes out).
        self.proxy.swallowing = True
        self.proxy.refusing = True
        self._refused_at_cut = self.proxy.refused
        asyncio.get_running_loop().call_soon(self.proxy.reset_all)

    def _opaque(self) -> None:
        self.opaque += 1
