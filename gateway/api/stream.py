"""The live stream (behaviour §5, §7): every outbox event as a Server-Sent Event.

Read from the outbox table, not from this node's memory, so every node's stream carries every
node's events. One hub per node: it LISTENs on ``outbox_event`` (with a polling fallback),
reads what became final with a pooled connection held only for that read, and fans each event
out to the open streams' bounded queues. A client that cannot keep up is disconnected and
resumes with ``Last-Event-ID``.

The cursor (the SSE ``id``) is ``xid:id``, see :mod:`storage.console`: an event is delivered only
once its transaction and every older one have ended, in (xid, id) order, so a reconnect from
any cursor resumes with no gap and no duplicate, on any node.

``EventSource`` cannot send headers: ``POST /stream/tickets`` gives a short-lived single-use
ticket (stored as a digest, so any node accepts it) for ``GET /stream?ticket=``. The long-lived
token never goes into a URL; ``curl`` sends it in the ``Authorization`` header as usual.

The response is Litestar's :class:`~litestar.response.Stream` (which ends it when the client
goes away) with the framing written here: Litestar's ``ServerSentEvent`` writes a ``data:``
line into every message, so its comment-only keep-alive reaches EventSource as an empty
message event; and resuming (``Last-Event-ID``) is not its business anyway.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Final

import asyncpg
import msgspec
import structlog
from litestar import Request
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import HeaderParameter, Parameter
from litestar.response import Stream

from gateway.api.auth import BearerAuth, CallDep, Caller, Role, log_refusal
from gateway.api.errors import (
    BAD_REQUEST,
    INTERNAL,
    UNAUTHORIZED,
    UNAVAILABLE,
    ApiError,
    bad_request,
)
from gateway.api.routes import route
from gateway.api.schemas import exact
from gateway.api.services import services_of
from gateway.support.loops import drain_on_notify
from storage import console as repo
from storage.console import Cursor, StreamEvent

log = structlog.get_logger(__name__)

TAG: Final = "stream"
NOTIFY_CHANNEL: Final = "outbox_event"
TICKET_LIFETIME_S: Final = 60.0
KEEPALIVE_S: Final = 15.0
QUEUE_MAX: Final = 1000
READ_BATCH: Final = 500
POLL_S: Final = 1.0
CURSOR_PATTERN: Final = r"^[0-9]{1,20}:[0-9]{1,19}$"
_CURSOR: Final = re.compile(CURSOR_PATTERN.removesuffix("$") + r"\Z")
TICKET_PATTERN: Final = r"^[A-Za-z0-9_-]{20,100}$"
_TICKET: Final = re.compile(TICKET_PATTERN.removesuffix("$") + r"\Z")


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
    return Cursor(int(xid), int(row_id))


_CLOSE: Final = object()  # in a queue: the hub dropped this stream


@dataclass(eq=False)
class _Subscriber:
    cursor: Cursor
    queue: asyncio.Queue[StreamEvent | object] = field(
        default_factory=lambda: asyncio.Queue(QUEUE_MAX + 1)
    )
    closed: bool = False

    def offer(self, event: StreamEvent) -> None:
        if self.closed or event.cursor <= self.cursor:
            return
        if self.queue.qsize() >= QUEUE_MAX:
            # Too slow: end its stream (the slot kept free for the marker); it resumes.
            self.close()
            return
        self.queue.put_nowait(event)
        self.cursor = event.cursor

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(_CLOSE)


class StreamHub:
    """One per node: one LISTEN connection, reads of what became final, fan-out to streams."""

    def __init__(self, pool: asyncpg.Pool, dsn: str, *, poll_s: float = POLL_S) -> None:
        self.pool = pool
        self.dsn = dsn
        self.poll_s = poll_s
        self.head: Cursor | None = None  # the newest event fanned out (None: not started)
        self._subscribers: set[_Subscriber] = set()
        self._lock = asyncio.Lock()
        self._started = asyncio.Event()
        self._closed = False  # the node is stopping: no stream opens any more

    def closed(self) -> bool:
        """Whether the hub stopped (a method: it changes across an ``await``)."""
        return self._closed

    @property
    def streams(self) -> int:
        return len(self._subscribers)

    async def run(self, stop: asyncio.Event) -> None:
        try:
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
            for subscriber in list(self._subscribers):
                subscriber.close()
            self._subscribers.clear()

    async def run_once(self) -> int:
        """Fan out the events that became final since the last pass; how many."""
        async with self._lock, self.pool.acquire() as conn:
            if self.head is None:
                self.head = await repo.stream_tail(conn)
                self._started.set()
                return 0
            if not self._subscribers:
                # Nobody to fan out to: move past what became final without reading it (one
                # index probe instead of a batch of payloads; a campaign writes thousands).
                self.head = max(self.head, await repo.stream_tail(conn))
                return 0
            horizon = await repo.stream_horizon(conn)
            events = await repo.stream_events(conn, self.head, horizon, READ_BATCH)
            for event in events:
                for subscriber in list(self._subscribers):
                    subscriber.offer(event)
            if events:
                self.head = events[-1].cursor
            # Dropped (too slow) streams leave the fan-out.
            self._subscribers = {s for s in self._subscribers if not s.closed}
        return len(events)

    async def events(self, after: Cursor | None) -> AsyncIterator[StreamEvent | None]:
        """The events after ``after`` (from now on with None), None every ``KEEPALIVE_S``
        without one; ends when the hub drops the stream (too slow, or shutting down)."""
        await self._started.wait()
        if self.closed():
            return
        cursor = after
        subscriber: _Subscriber | None = None
        try:
            while subscriber is None:
                async with self._lock:
                    if self.closed():  # stopped while this stream caught up
                        return
                    assert self.head is not None
                    head = self.head
                    if cursor is None or cursor >= head:
                        subscriber = _Subscriber(cursor or head)
                        self._subscribers.add(subscriber)
                        break
                assert cursor is not None  # None registers at once, above
                # Behind the hub: catch up from the table (final up to the hub's head).
                # Every event up to the head has an xid <= head.xid, all ended: final.
                async with self.pool.acquire() as conn:
                    batch = await repo.stream_events(conn, cursor, head.xid + 1, READ_BATCH)
                if not batch:
                    cursor = head  # nothing left between the cursor and the head
                for event in batch:
                    yield event
                    cursor = event.cursor
            yield None  # live from here on: a first comment says so
            while True:
                try:
                    item = await asyncio.wait_for(subscriber.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield None
                    continue
                if item is _CLOSE:
                    return
                assert isinstance(item, StreamEvent)
                yield item
        finally:
            if subscriber is not None:
                subscriber.close()
                self._subscribers.discard(subscriber)

    async def issue_ticket(self, caller: Caller) -> Ticket:
        secret = secrets.token_urlsafe(32)
        async with self.pool.acquire() as conn:
            await repo.drop_old_tickets(conn)
            expires_at = await repo.insert_ticket(
                conn,
                digest=_digest(secret),
                token_name=caller.name,
                role=caller.role.label,
                lifetime_s=TICKET_LIFETIME_S,
            )
        return Ticket(ticket=secret, expires_at=expires_at)

    async def redeem(self, ticket: str) -> Caller | None:
        if _TICKET.match(ticket) is None:
            return None
        async with self.pool.acquire() as conn:
            found = await repo.use_ticket(conn, _digest(ticket))
        return None if found is None else Caller(name=found[0], role=Role[found[1].upper()])


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


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
    description=(
        f"Valid for {TICKET_LIFETIME_S:g} s, once, on any node; it carries this token's name "
        "and role. The long-lived token never travels in a URL."
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
    errors=[BAD_REQUEST, UNAUTHORIZED, UNAVAILABLE, INTERNAL],
    media_type="text/event-stream",
    description=(
        "Authenticated by `ticket` (from `POST /stream/tickets`, for EventSource) or by the "
        "usual `Authorization: Bearer` header (any role); never by a token in the URL. Each "
        "event: `id: <cursor>`, `event: <event_type>`, `data: {event_id, event_type, "
        "aggregate_type, aggregate_id, payload, created_at}`; a comment every "
        f"{KEEPALIVE_S:g} s keeps it alive. Resume after the event whose `id` is given by "
        "`Last-Event-ID` (EventSource sends it on reconnect) or `last_event_id`: no gap, no "
        "duplicate for events still in the outbox. Without either it starts with the events "
        "that come next."
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
    if ticket is not None:
        caller = await hub.redeem(ticket)
        if caller is None:
            log_refusal("stream_ticket_refused", remote=_remote(request))
            raise ApiError(UNAUTHORIZED, "the ticket is unknown, used or expired")
    else:
        try:
            caller = auth.authorize(request.headers.get("authorization"), Role.VIEWER)
        except ApiError:
            log_refusal("api_access_refused", status=401, path="/stream", remote=_remote(request))
            raise
    given = last_event_id if last_event_id is not None else last_event_header
    after = None if not given else parse_cursor(given, "Last-Event-ID")
    log.info("stream_opened", token=caller.name, after=None if after is None else str(after))
    return Stream(
        _frames(hub, after),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _frames(hub: StreamHub, after: Cursor | None) -> AsyncIterator[bytes]:
    async for event in hub.events(after):
        yield KEEPALIVE_FRAME if event is None else frame(event)


def _remote(request: Request[Any, Any, Any]) -> str | None:
    client = request.client
    return None if client is None else client.host


HANDLERS: Final = [create_ticket, stream]
