"""The live stream (behaviour §5, §7): every outbox event as a Server-Sent Event.

Read from the outbox table, not from this node's memory, so every node's stream carries every
node's events. One hub per node: it LISTENs on ``outbox_event`` (with a polling fallback),
reads what became final with a pooled connection held only for that read, and fans each event
out to the open streams: each event's frame is encoded once and the same bytes go to every
stream, the frames waiting for a stream leaving in one write.

Hard limits, because every open stream costs the node a socket, kernel buffers and a share of
each fan-out: ``[http] max_streams`` per node and ``max_streams_per_token``; a client
``QUEUE_MAX`` events behind, or whose socket has taken nothing for ``WRITE_DEADLINE_S`` (it
stopped reading), is dropped with its connection reset (see :meth:`ApiServer.abort`), and
resumes with ``Last-Event-ID``; a reload cuts the streams of the tokens it removes or rotates;
a cursor past every event written is refused (it would wait for nothing).

A stream is a person-facing channel (behaviour §5): an alarm's ``alarm.created`` (or
``alarm.woken``) event that a stream wrote to its client, the chunk handed to the connection's
transport while the connection still stood, pushes the alarm if it is still NEW. The streams
note what they wrote; the hub pushes in rounds, one statement finding which of all the alarms
written since the last round are still NEW (see :func:`~gateway.alarms.delivery.reached_on_stream`).
A frame queued for a stream that is dropped or whose client went away counts for nothing.

The cursor (the SSE ``id``) is ``xid:id``, see :mod:`storage.console`: an event is delivered only
once its transaction and every older one have ended, in (xid, id) order, so a reconnect from
any cursor resumes with no gap and no duplicate, on any node. A stream whose cursor is past
the hub's head when it goes live (it came from a node further on, or its catch-up read ended
past the head) skips, in the fan-out, what its client already has.

``EventSource`` cannot send headers: ``POST /stream/tickets`` gives a short-lived single-use
ticket (stored as a digest, so any node accepts it) for ``GET /stream?ticket=``, at a bounded
rate per token; the maintenance pass deletes expired ones. The long-lived token never goes into
a URL; ``curl`` sends it in the ``Authorization`` header as usual.

The response is Litestar's :class:`~litestar.response.Stream` (which ends it when the client
goes away) with the framing written here: Litestar's ``ServerSentEvent`` writes a ``data:``
line into every message, so its comment-only keep-alive reaches EventSource as an empty
message event; and resuming (``Last-Event-ID``) is not its business anyway.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import re
import secrets
from collections import deque
from collections.abc import AsyncGenerator, Callable
from datetime import datetime
from typing import Annotated, Any, Final

import asyncpg
import msgspec
import structlog
from litestar import Request
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPI, OpenAPIMediaType, OpenAPIType, Reference, Schema
from litestar.params import HeaderParameter, Parameter
from litestar.response import Stream

from gateway.alarms.delivery import reached_on_stream
from gateway.alarms.lifecycle import AGGREGATE
from gateway.api.auth import BearerAuth, CallDep, Caller, Role, log_refusal
from gateway.api.errors import (
    BAD_REQUEST,
    CURSOR_AHEAD,
    INTERNAL,
    STREAMS_FULL,
    TOO_MANY_STREAMS,
    TOO_MANY_TICKETS,
    UNAUTHORIZED,
    UNAVAILABLE,
    ApiError,
    ErrorKind,
    bad_request,
)
from gateway.api.metrics import StreamMetrics
from gateway.api.routes import route
from gateway.api.schemas import exact
from gateway.api.server import STATE_SERVER, ApiServer
from gateway.api.services import services_of
from gateway.config import HttpConfig
from gateway.domain.quiet_hours import QuietHours
from gateway.support.loops import (
    RETRYABLE,
    drain_on_notify,
    every,
    sleep_unless_stopped,
    wait_event_or_stop,
)
from gateway.support.metrics import Metrics
from protocol.events import EventType
from storage import console as repo
from storage.console import Cursor, StreamEvent

log = structlog.get_logger(__name__)

TAG: Final = "stream"
NOTIFY_CHANNEL: Final = "outbox_event"
TICKET_LIFETIME_S: Final = 60.0
KEEPALIVE_S: Final = 15.0
QUEUE_MAX: Final = 1000  # events a stream may be behind; one more and it is dropped
READ_BATCH: Final = 500
POLL_S: Final = 1.0
# A chunk the client's socket has not taken within this (its buffers are full: it stopped
# reading) drops the stream, however few events are queued. Checked every WATCH_S.
WRITE_DEADLINE_S: Final = 10.0
WATCH_S: Final = 1.0
MAX_STREAMS: Final = HttpConfig().max_streams
MAX_STREAMS_PER_TOKEN: Final = HttpConfig().max_streams_per_token
RETRY_AFTER_S: Final = 5
TICKET_BURST: Final = 10
TICKET_EVERY_S: Final = 6.0
XID_MAX: Final = 2**64 - 1
ID_MAX: Final = 2**63 - 1
CURSOR_PATTERN: Final = r"^[0-9]{1,20}:[0-9]{1,19}$"
_CURSOR: Final = re.compile(CURSOR_PATTERN.removesuffix("$") + r"\Z")
TICKET_PATTERN: Final = r"^[A-Za-z0-9_-]{20,100}$"
_TICKET: Final = re.compile(TICKET_PATTERN.removesuffix("$") + r"\Z")
# The events whose writing to a client reaches a person with the alarm (as their publish does
# over MQTT 5): its creation, and its wake-up after quiet hours.
REACH_EVENTS: Final = frozenset({EventType.ALARM_CREATED, EventType.ALARM_WOKEN})
# A round of pushes that failed (the database away) is tried again after this.
REACH_RETRY_S: Final = 1.0


class StreamData(msgspec.Struct, kw_only=True):
    """The ``data`` of every event of the stream: the outbox event as written."""

    event_id: str
    event_type: str
    aggregate_type: str
    aggregate_id: str
    payload: dict[str, Any]
    created_at: datetime


class Ticket(msgspec.Struct, kw_only=True):
    """A single-use ticket for ``GET /stream?ticket=``, valid until ``expires_at``."""

    ticket: str
    expires_at: datetime


def parse_cursor(text: str, param: str) -> Cursor:
    if _CURSOR.match(text) is None:
        raise bad_request(param, "not a stream cursor (`xid:id`, an event's `id`)")
    xid, _, row_id = text.partition(":")
    if int(xid) > XID_MAX or int(row_id) > ID_MAX:
        raise bad_request(param, "out of range for a stream cursor")
    return Cursor(int(xid), int(row_id))


class _Stream:
    """One open stream: who opened it, how to cut its connection, and the frames waiting to be
    written (bytes encoded once by the hub, shared by every stream)."""

    __slots__ = (
        "abort",
        "caller",
        "closed",
        "connected",
        "dropped",
        "frames",
        "live",
        "opened_at",
        "reach",
        "skip_to",
        "started",
        "wake",
        "writing_since",
    )

    def __init__(
        self,
        caller: Caller,
        abort: Callable[[], object],
        now: float,
        connected: Callable[[], bool],
    ) -> None:
        self.caller = caller
        self.abort = abort
        # Whether its connection still stands (the server's transport not lost nor closing):
        # asked after a chunk was handed over, since a server drops a chunk for a connection
        # already lost without a word.
        self.connected = connected
        self.opened_at = now
        self.frames: deque[bytes] = deque()
        # The alarms whose creation (or wake-up) is among the queued frames.
        self.reach: list[int] = []
        self.dropped = False  # cut by the hub: what it still yields reaches nobody
        self.wake = asyncio.Event()
        self.live = False  # in the fan-out: caught up with the hub
        # Its client already has every event up to here, past the hub's head when it went
        # live (a cursor from another node, or a catch-up that read further than the hub):
        # the fan-out skips them. None: nothing to skip.
        self.skip_to: Cursor | None = None
        self.started = False  # its answer began (the body is being iterated)
        self.closed = False  # ends after what is queued
        # Since when a chunk handed to the server has not been taken (the server waits for
        # the socket to drain before it asks for the next one); None when none is pending.
        self.writing_since: float | None = None

    def offer(self, frames: list[bytes], reach: list[int]) -> bool:
        """Queue ``frames`` (``reach``: the alarms they create or wake); False when that would
        leave it more than ``QUEUE_MAX`` behind (what fits is queued: it ends after those, and
        is dropped)."""
        room = QUEUE_MAX - len(self.frames)
        self.frames.extend(frames[:room] if len(frames) > room else frames)
        self.reach.extend(reach)
        self.wake.set()
        return len(frames) <= room

    def close(self) -> None:
        self.closed = True
        self.wake.set()

    def ended(self) -> bool:
        """Whether it was closed (a method: it changes across an ``await``)."""
        return self.closed


def _no_abort() -> None:
    """Outside a server (the hub driven by hand): nothing to cut."""


def _connected() -> bool:
    """Outside a server (the hub driven by hand): what the body yields is taken as written."""
    return True


class StreamHub:
    """One per node: one LISTEN connection, reads of what became final, fan-out to streams;
    the streams' limits, their write deadline, and the tickets."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        dsn: str,
        *,
        poll_s: float = POLL_S,
        max_streams: int = MAX_STREAMS,
        max_streams_per_token: int = MAX_STREAMS_PER_TOKEN,
        write_deadline_s: float = WRITE_DEADLINE_S,
        metrics: Metrics | None = None,
        node_id: str,
        quiet: QuietHours | None = None,
    ) -> None:
        self.pool = pool
        self.dsn = dsn
        self.node_id = node_id
        # Reloadable: the quiet hours that hold an alarm back rather than a stream pushing it.
        self.quiet = quiet
        self.poll_s = poll_s
        # Reloadable (SIGHUP); streams already open stay.
        self.max_streams = max_streams
        self.max_streams_per_token = max_streams_per_token
        self.write_deadline_s = write_deadline_s
        self.metrics = metrics
        self.stream_metrics = None if metrics is None else StreamMetrics.of(metrics.registry)
        if self.stream_metrics is not None:
            self.stream_metrics.streams_open.set_function(lambda: len(self._streams))
        self.head: Cursor | None = None  # the newest event fanned out (None: not started)
        self._streams: set[_Stream] = set()  # open, caught up or not
        self._live: set[_Stream] = set()  # the fan-out
        self._buckets: dict[str, tuple[float, float]] = {}  # token name: (tickets, at)
        self._lock = asyncio.Lock()
        self._started = asyncio.Event()
        self._closed = False  # the node is stopping: no stream opens any more
        # Alarms a stream wrote since the last round of pushes: id → the stream that did.
        self._written: dict[int, str] = {}
        self._written_wake = asyncio.Event()

    def closed(self) -> bool:
        """Whether the hub stopped (a method: it changes across an ``await``)."""
        return self._closed

    @property
    def streams(self) -> int:
        return len(self._streams)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(
                    every(WATCH_S, stop, self.watch_once, name="stream-watch"), name="stream-watch"
                )
                tasks.create_task(self._reach_loop(stop), name="stream-reach")
                await drain_on_notify(
                    dsn=self.dsn,
                    channel=NOTIFY_CHANNEL,
                    stop=stop,
                    step=self.run_once,
                    poll_s=self.poll_s,
                    name="stream-hub",
                )
        finally:
            self._closed = True
            self._started.set()
            for stream in list(self._streams):
                stream.close()
            self._streams.clear()
            self._live.clear()

    async def run_once(self) -> int:
        """Fan out the events that became final since the last pass; how many."""
        async with self._lock, self.pool.acquire() as conn:
            if self.head is None:
                self.head = await repo.stream_tail(conn)
                self._started.set()
                return 0
            if not self._live:
                # Nobody to fan out to: move past what became final without reading it (one
                # index probe instead of a batch of payloads; a campaign writes thousands).
                tail = await repo.stream_tail(conn)
                if tail < self.head and await repo.stream_cursor_ahead(conn, self.head):
                    self._behind(tail)
                else:
                    self.head = max(self.head, tail)
                return 0
            horizon = await repo.stream_horizon(conn)
            events = await repo.stream_events(conn, self.head, horizon, READ_BATCH)
            if not events and await repo.stream_cursor_ahead(conn, self.head):
                self._behind(await repo.stream_tail(conn))
            if events:
                # Encoded once, whatever the number of streams: they share the bytes.
                frames = [frame(event) for event in events]
                reach = reaching(events)
                for stream in list(self._live):
                    offered, offered_reach = frames, reach
                    skip_to = stream.skip_to
                    if skip_to is not None:
                        # Only what its client does not have yet.
                        fresh = [i for i, e in enumerate(events) if e.cursor > skip_to]
                        if not fresh:
                            continue
                        stream.skip_to = None
                        offered = frames[fresh[0] :]
                        offered_reach = reaching(events[fresh[0] :])
                    if not stream.offer(offered, offered_reach):
                        self._drop(stream, "behind")
                self.head = events[-1].cursor
        return len(events)

    def _behind(self, tail: Cursor) -> None:
        """The database is behind the head (a failover to a standby that was behind, a
        restore): no event past the head may ever come. The live streams are cut (their
        clients resume from a cursor now ahead, are told so, and start over: what they saw
        may be gone) and the head starts again from the database's newest event."""
        log.warning("stream_database_behind", head=str(self.head), tail=str(tail))
        for stream in list(self._streams):
            self._drop(stream, "database_behind")
        self.head = tail

    async def watch_once(self) -> None:
        """Drop the streams whose client stopped reading: a chunk not taken within the write
        deadline (the socket's buffers are full), or an answer that never began."""
        now = asyncio.get_running_loop().time()
        for stream in list(self._streams):
            if stream.writing_since is not None:
                if now - stream.writing_since > self.write_deadline_s:
                    self._drop(stream, "stalled")
            elif not stream.started and now - stream.opened_at > self.write_deadline_s:
                self._release(stream)  # the server never asked for its body

    def open(
        self,
        caller: Caller,
        abort: Callable[[], object] = _no_abort,
        connected: Callable[[], bool] = _connected,
    ) -> _Stream:
        """Take a place for a stream of ``caller``, within the limits; :meth:`events` gives
        its body (and gives the place back when it ends). ``abort`` cuts its connection;
        ``connected`` says whether it still stands."""
        if self._closed:
            raise ApiError(UNAVAILABLE, "the node is stopping; retry on another one")
        if len(self._streams) >= self.max_streams:
            raise self._refused(
                STREAMS_FULL,
                f"this node has {self.max_streams} streams open, its limit",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        mine = sum(1 for s in self._streams if s.caller.name == caller.name)
        if mine >= self.max_streams_per_token:
            raise self._refused(
                TOO_MANY_STREAMS,
                f"the token {caller.name!r} has {mine} streams open on this node, its limit",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        stream = _Stream(caller, abort, asyncio.get_running_loop().time(), connected)
        self._streams.add(stream)
        return stream

    def _refused(self, kind: ErrorKind, message: str, *, headers: dict[str, str]) -> ApiError:
        if self.stream_metrics is not None:
            self.stream_metrics.stream_refusals.labels(kind.code).inc()
        return ApiError(kind, message, headers=headers)

    def revoke(self, holds: Callable[[Caller], bool]) -> int:
        """End at once the streams of tokens no longer configured (a reload); how many."""
        gone = [s for s in self._streams if not holds(s.caller)]
        for stream in gone:
            self._drop(stream, "revoked")
        return len(gone)

    def _drop(self, stream: _Stream, reason: str) -> None:
        """End a stream now: its connection is cut (a write may be stuck on a full socket, and
        nothing more of a revoked token's goes out); its client resumes with its last id."""
        if stream not in self._streams:
            return
        log.warning(
            "stream_dropped", token=stream.caller.name, reason=reason, queued=len(stream.frames)
        )
        if self.stream_metrics is not None:
            self.stream_metrics.streams_dropped.labels(reason).inc()
        stream.dropped = True
        stream.close()
        self._release(stream)
        stream.abort()

    def _release(self, stream: _Stream) -> None:
        stream.closed = True
        self._streams.discard(stream)
        self._live.discard(stream)

    async def cursor_ahead(self, cursor: Cursor) -> bool:
        """Whether ``cursor`` is past every event written: no stream can have sent it."""
        head = self.head
        if head is not None and cursor <= head:
            return False
        async with self.pool.acquire() as conn:
            return await repo.stream_cursor_ahead(conn, cursor)

    async def events(self, stream: _Stream, after: Cursor | None) -> AsyncGenerator[bytes, None]:
        """The body of ``stream``: the frames after ``after`` (from now on with None), a
        comment once live and every ``KEEPALIVE_S`` without an event; several frames waiting
        go out as one chunk. Ends when the hub drops the stream or stops."""
        loop = asyncio.get_running_loop()
        try:
            stream.started = True
            await self._started.wait()
            if self.closed() or stream.ended():
                return
            cursor = after
            while not stream.live:
                async with self._lock:
                    if self.closed() or stream.ended():  # stopped while this one caught up
                        return
                    assert self.head is not None
                    head = self.head
                    if cursor is None or cursor >= head:
                        if cursor is not None and cursor > head:
                            stream.skip_to = cursor  # the hub has yet to pass what it has
                        stream.live = True
                        self._live.add(stream)
                        break
                assert cursor is not None  # None goes live at once, above
                # Behind the hub: catch up from the table (final up to the hub's head).
                # Every event up to the head has an xid <= head.xid, all ended: final.
                async with self.pool.acquire() as conn:
                    batch = await repo.stream_events(conn, cursor, head.xid + 1, READ_BATCH)
                if not batch:
                    cursor = head  # nothing left between the cursor and the head
                    continue
                stream.writing_since = loop.time()
                yield b"".join(frame(event) for event in batch)
                stream.writing_since = None
                self._wrote(stream, reaching(batch))
                cursor = batch[-1].cursor
            # Live from here on: a first comment says so.
            chunk: bytes = KEEPALIVE_FRAME
            reach: list[int] = []
            while True:
                stream.writing_since = loop.time()
                yield chunk
                stream.writing_since = None
                self._wrote(stream, reach)
                following = await self._next_chunk(stream)
                if following is None:
                    return
                chunk, reach = following
        finally:
            self._release(stream)

    async def _next_chunk(self, stream: _Stream) -> tuple[bytes, list[int]] | None:
        """What a live stream writes next: the frames waiting, as one chunk, with the alarms
        they create or wake; a comment after ``KEEPALIVE_S`` without any; None when it ends."""
        if not stream.frames:
            if stream.ended():
                return None
            stream.wake.clear()
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    await stream.wake.wait()
            except TimeoutError:
                return KEEPALIVE_FRAME, []
            if not stream.frames:  # woken to end
                return None
        chunk = b"".join(stream.frames)
        stream.frames.clear()
        reach, stream.reach = stream.reach, []
        return chunk, reach

    def _wrote(self, stream: _Stream, alarm_ids: list[int]) -> None:
        """``stream`` wrote the creation (or wake-up) of ``alarm_ids``: the server asked for its
        next chunk, so the last one went to the connection's transport, if that still stands
        (a server drops a chunk for a lost connection silently) and the hub did not cut it."""
        if not alarm_ids or stream.dropped or not stream.connected():
            return
        via = f"console stream (token {stream.caller.name})"
        for alarm_id in alarm_ids:
            self._written.setdefault(alarm_id, via)
        self._written_wake.set()

    async def _reach_loop(self, stop: asyncio.Event) -> None:
        """Push what the streams wrote, a round at a time: all the alarms written since the
        last round in one statement. What was written before the stop is pushed at the stop."""
        while True:
            await wait_event_or_stop(self._written_wake, stop, KEEPALIVE_S)
            self._written_wake.clear()
            stopping = stop.is_set()
            try:
                await self.reach_once()
            except RETRYABLE as exc:
                log.warning("stream_reach_failed", error=repr(exc), retry_in_s=REACH_RETRY_S)
                if stopping:
                    return
                await sleep_unless_stopped(stop, REACH_RETRY_S)
                self._written_wake.set()  # the same alarms again
                continue
            if stopping:
                return

    async def reach_once(self) -> list[int]:
        """One round: the alarms written since the last round that are still NEW are pushed
        (unless quiet hours hold them back); the ids pushed. On failure they wait for the next
        round."""
        written, self._written = self._written, {}
        if not written:
            return []
        try:
            async with self.pool.acquire() as conn:
                pushed = await reached_on_stream(
                    conn, written, quiet=self.quiet, node_id=self.node_id
                )
        except BaseException:
            for alarm_id, via in written.items():
                self._written.setdefault(alarm_id, via)
            raise
        for alarm_id in pushed:
            log.info("alarm_reached", alarm_id=alarm_id, via=written[alarm_id])
            if self.metrics is not None:
                self.metrics.count_alarm_transition("NEW", "PUSHED")
        return pushed

    async def issue_ticket(self, caller: Caller) -> Ticket:
        self._take_ticket(caller.name)
        secret = secrets.token_urlsafe(32)
        async with self.pool.acquire() as conn:
            expires_at = await repo.insert_ticket(
                conn,
                digest=_digest(secret),
                token_name=caller.name,
                role=caller.role.label,
                lifetime_s=TICKET_LIFETIME_S,
                token_check=_token_check(secret, caller),
            )
        return Ticket(ticket=secret, expires_at=expires_at)

    def _take_ticket(self, name: str) -> None:
        """A token bucket per token (and node): ``TICKET_BURST`` at once, then one every
        ``TICKET_EVERY_S``. A page that opens a stream takes one; thousands a minute is not
        a page."""
        now = asyncio.get_running_loop().time()
        left, at = self._buckets.get(name, (float(TICKET_BURST), now))
        left = min(float(TICKET_BURST), left + (now - at) / TICKET_EVERY_S)
        if left < 1.0:
            self._buckets[name] = (left, now)
            wait = math.ceil((1.0 - left) * TICKET_EVERY_S)
            raise self._refused(
                TOO_MANY_TICKETS,
                f"the token {name!r} asked for tickets too fast; the next one in {wait} s",
                headers={"Retry-After": str(wait)},
            )
        self._buckets[name] = (left - 1.0, now)

    async def redeem(self, ticket: str, auth: BearerAuth) -> Caller | None:
        """The caller of a valid ticket, used up now; None when unknown, used, expired, or
        the token it was issued to is not configured any more under its name and role (a
        reload removed it, changed its role, or rotated it: same name, a new secret)."""
        if _TICKET.match(ticket) is None:
            return None
        async with self.pool.acquire() as conn:
            found = await repo.use_bound_ticket(conn, _digest(ticket))
        if found is None:
            return None
        name, role, check = found
        caller = auth.named(name, Role[role.upper()])
        if caller is None or check is None:
            return None
        return caller if hmac.compare_digest(_token_check(ticket, caller), check) else None


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _token_check(ticket: str, caller: Caller) -> bytes:
    """What binds a ticket to the token it was issued to (``caller.key``, the token's digest):
    stored with the ticket, it reveals neither without the ticket, which is never stored."""
    return hashlib.sha256(b"gateway stream ticket\0" + ticket.encode() + caller.key).digest()


def reaching(events: list[StreamEvent]) -> list[int]:
    """The alarms that ``events`` create or wake: written to a client, they reached a person."""
    return [
        int(event.aggregate_id)
        for event in events
        if event.event_type in REACH_EVENTS and event.aggregate_type == AGGREGATE
    ]


def frame(event: StreamEvent) -> bytes:
    """One event on the wire: ``id``, ``event`` and one ``data`` line (JSON has no raw line
    breaks), then the blank line that ends it."""
    data = (
        b'{"event_id":'
        + msgspec.json.encode(event.event_id)
        + b',"event_type":'
        + msgspec.json.encode(event.event_type)
        + b',"aggregate_type":'
        + msgspec.json.encode(event.aggregate_type)
        + b',"aggregate_id":'
        + msgspec.json.encode(event.aggregate_id)
        + b',"payload":'
        + event.payload.replace("\n", " ").encode()  # jsonb's text: JSON already
        + b',"created_at":'
        + msgspec.json.encode(event.created_at)
        + b"}"
    )
    event_type = re.sub(r"[\r\n]", "", event.event_type).encode()
    return b"id: %s\nevent: %s\ndata: %s\n\n" % (str(event.cursor).encode(), event_type, data)


KEEPALIVE_FRAME: Final = b": keep-alive\n\n"


@route(
    "POST",
    "/stream/tickets",
    summary="A short-lived single-use ticket for GET /stream (EventSource sends no headers)",
    operation_id="createStreamTicket",
    tag=TAG,
    role=Role.VIEWER,
    status_code=201,
    errors=[TOO_MANY_TICKETS],
    description=(
        f"Valid for {TICKET_LIFETIME_S:g} s, once, on any node; it carries this token's name "
        "and role (a reload that removes or rotates the token voids it). The long-lived token "
        f"never travels in a URL. Each token gets {TICKET_BURST} at once, then one every "
        f"{TICKET_EVERY_S:g} s (per node): more is `429 TOO_MANY_TICKETS` with `Retry-After`."
    ),
)
async def create_ticket(request: Request[Any, Any, Any], call: CallDep) -> Ticket:
    hub = services_of(request).hub()
    return await hub.issue_ticket(call.caller)


@route(
    "GET",
    "/stream",
    summary="Every outbox event as Server-Sent Events, live, resumable",
    operation_id="stream",
    tag=TAG,
    role=None,
    errors=[
        BAD_REQUEST,
        CURSOR_AHEAD,
        UNAUTHORIZED,
        TOO_MANY_STREAMS,
        STREAMS_FULL,
        UNAVAILABLE,
        INTERNAL,
    ],
    media_type="text/event-stream",
    description=(
        "Authenticated by `ticket` (from `POST /stream/tickets`, for EventSource) or by the "
        "usual `Authorization: Bearer` header (any role); never by a token in the URL. Each "
        "event: `id: <cursor>`, `event: <event_type>`, `data: {event_id, event_type, "
        "aggregate_type, aggregate_id, payload, created_at}`; a comment every "
        f"{KEEPALIVE_S:g} s keeps it alive. Resume after the event whose `id` is given by "
        "`Last-Event-ID` (EventSource sends it on reconnect) or `last_event_id`: no gap, no "
        "duplicate for events still in the outbox; a cursor past every event written is "
        "`400 CURSOR_AHEAD`. Without either it starts with the events that come next. At most "
        "`[http] max_streams` streams are open on a node (then `503 STREAMS_FULL`), and "
        "`[http] max_streams_per_token` of one token (then `429 TOO_MANY_STREAMS`). A client "
        f"{QUEUE_MAX} events behind, or whose socket takes nothing for {WRITE_DEADLINE_S:g} s, "
        "is disconnected (it resumes with its last `id`); so are the streams of a token that a "
        "reload removes."
    ),
    also={
        200: ResponseSpec(
            data_container=StreamData,
            generate_examples=False,
            media_type="text/event-stream",
            description="`text/event-stream`; each event's `data` is this object.",
        )
    },
)
async def stream(
    request: Request[Any, Any, Any],
    ticket: Annotated[
        str | None,
        Parameter(
            pattern=TICKET_PATTERN,
            schema_extra=exact("string"),
            description="A ticket from `POST /stream/tickets` (single use, short-lived).",
        ),
    ] = None,
    last_event_id: Annotated[
        str | None,
        Parameter(
            pattern=CURSOR_PATTERN,
            schema_extra=exact("string"),
            description="Resume after this event `id` (as the `Last-Event-ID` header).",
        ),
    ] = None,
    last_event_header: Annotated[
        str | None,
        HeaderParameter(
            name="Last-Event-ID",
            pattern=CURSOR_PATTERN,
            schema_extra=exact("string"),
            description="Resume after this event `id` (EventSource sends it on reconnect).",
        ),
    ] = None,
) -> Stream:
    hub = services_of(request).hub()
    auth: BearerAuth = request.app.state["auth"]
    given = last_event_id if last_event_id is not None else last_event_header
    param = "last_event_id" if last_event_id is not None else "Last-Event-ID"
    after = None if not given else parse_cursor(given, param)
    if ticket is not None:
        caller = await hub.redeem(ticket, auth)
        if caller is None:
            log_refusal("stream_ticket_refused", remote=_remote(request))
            raise ApiError(UNAUTHORIZED, "the ticket is unknown, used, expired or revoked")
    else:
        try:
            caller = auth.authorize(request.headers.get("authorization"), Role.VIEWER)
        except ApiError:
            log_refusal("api_access_refused", status=401, path="/stream", remote=_remote(request))
            raise
    if after is not None and await hub.cursor_ahead(after):
        # Accepted, it would wait for that event and send nothing until then: a client's bug.
        raise ApiError(
            CURSOR_AHEAD, f"{param}: {after} is past every event written so far", param=param
        )
    if not auth.holds(caller):
        # A reload removed (or rotated) the token while this request waited for the database
        # (above): it cut the token's streams then, and must not see one open now. From here
        # to `hub.open` nothing awaits.
        log_refusal("api_access_refused", status=401, path="/stream", remote=_remote(request))
        raise ApiError(UNAUTHORIZED, "the token was revoked while the stream was opening")
    server = request.app.state.get(STATE_SERVER)
    client = request.scope.get("client")
    if isinstance(server, ApiServer):
        opened = hub.open(caller, lambda: server.abort(client), lambda: server.connected(client))
    else:
        opened = hub.open(caller)
    log.info("stream_opened", token=caller.name, after=None if after is None else str(after))
    return Stream(
        hub.events(opened, after),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


def complete(document: OpenAPI) -> None:
    """The stream's answer as it is served. Generated from ``StreamData``, the document would
    say the body is one such object (and a client checking it finds a first "event", the
    comment, without ``aggregate_id``): the body is text, and ``StreamData`` is what each
    event's ``data`` line holds (it stays in the components, named by the description)."""
    paths = document.paths or {}
    operation = paths["/stream"].get
    assert operation is not None
    assert operation.responses is not None
    response = operation.responses["200"]
    assert not isinstance(response, Reference)
    response.description = (
        "`text/event-stream`: events of an `id` line (the cursor), an `event` line (the "
        "event's type) and one `data` line, a `StreamData` object (see the components) with "
        "every one of its properties; lines that begin with `:` are comments (the first says "
        "the stream is live, then one keeps it alive every "
        f"{KEEPALIVE_S:g} s), not events."
    )
    response.content = {
        "text/event-stream": OpenAPIMediaType(
            schema=Schema(type=OpenAPIType.STRING, content_media_type="text/event-stream")
        )
    }


def _remote(request: Request[Any, Any, Any]) -> str | None:
    client = request.client
    return None if client is None else client.host


HANDLERS: Final = [create_ticket, stream]
