"""Publishes outbox events to the broker: claimed with a lease, PUBLISHED only after PUBACK.

Any node may publish. A claim takes only the oldest unpublished event of each aggregate, so
events of one aggregate go out in order; a publisher that dies mid-publish loses its lease
and another node publishes the event again (at least once — consumers are idempotent by
event id). Publishing an alarm's creation event pushes it only if the publish reached someone
(docs/behaviour.md §5): an MQTT 5 PUBACK with reason code 0 — there were subscribers. Then the
same transaction that marks the event published moves the alarm NEW → PUSHED, conditional on
it still being NEW. A PUBACK with 0x10 (no matching subscribers), or any 3.1.1 PUBACK (which
cannot say), marks the event published and leaves the alarm NEW: a notification delivery may
still push it (gateway.notify.worker).

A failed publish is retried with a growing backoff, unless it failed because the node's broker
session was down: then the event is due again at once, with its retry count unchanged, and
the publisher claims nothing until the session is back, which wakes it (it still reads the
backlog gauges, which the outage makes grow). So events raised during a broker outage go out
as soon as the broker returns, not at their next retry.

An event the broker can never take (larger than its maximum packet size, refused unsent or
answered 0x95; or a topic or payload it refuses for good: a final ``PublishRefused``) becomes
``DEAD`` with the reason in ``last_error``, logged once (``outbox_event_dead``) and counted; it
is never retried, and no longer holds back its aggregate's later events. It stays in the
database, where the node's own consumers (notifications, streams) read events anyway.

A broker that closes the connection on a packet over its limit, without a word (mosquitto's
``max_packet_size`` on MQTT 3.1.1, which has no reason codes), looks like a session that went
down with the event in doubt: released, due at once, it dropped the connection of every node
that took it, in a loop. So the largest events of a batch in doubt when the connection ended
are counted (``in_doubt_count``, across nodes), and one that ends the connection for the
``IN_DOUBT_LIMIT``-th time is given up as ``DEAD`` like a refused one.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import asyncpg
import msgspec
import structlog

from gateway.alarms.delivery import deliver
from gateway.config import OutboxConfig
from gateway.domain.quiet_hours import QuietHours
from gateway.outbox.metrics import OutboxMetrics
from gateway.support.backoff import Backoff
from gateway.support.broker_link import BrokerLink, PublishInDoubt, SessionDown
from gateway.support.loops import drain_on_notify
from gateway.support.metrics import Metrics
from gateway.support.node import Node, Publish
from gateway.support.publish_refusal import PublishRefused
from protocol import Topics
from protocol.events import EventType
from storage import outbox
from storage.errors import DB_ERRORS
from storage.outbox import ClaimedEvent

log = structlog.get_logger(__name__)

NOTIFY_CHANNEL = "outbox_event"
# Push transactions running at once, per publisher.
DELIVERY_CONCURRENCY = 2
# Publishing these is what brings an alarm to people: then it is pushed (or held back).
DELIVERING_EVENTS = frozenset({EventType.ALARM_CREATED, EventType.ALARM_WOKEN})
# MQTT 5 PUBACK reason code 0, SUCCESS: the broker had subscribers for it (without any it
# answers 0x10, NO_MATCHING_SUBSCRIBERS).
PUBACK_SUBSCRIBED = 0
# The backlog gauges are read at most this often (the loop also passes every poll_s when idle):
# the count visits every unpublished event, and the index entries of those published since the
# last vacuum; in a burst of commands one read a pass cost 13 ms, more than the pass itself.
BACKLOG_EVERY_S = 1.0
# The connection ended this many times while an event was the largest publish awaiting its
# PUBACK: the broker closes it for that event (over its packet limit), not by chance. DEAD.
IN_DOUBT_LIMIT = 3


@dataclass(frozen=True, slots=True)
class _Sent:
    """The broker has the event; ``reached``: whom it reached (None: nobody it could name)."""

    reached: str | None


class OutboxPublisher:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        dsn: str,
        node_id: str,
        topics: Topics,
        publish: Publish,
        metrics: Metrics,
        lease_s: float = 30.0,
        batch: int = 100,
        poll_s: float = 1.0,
        retry_base_s: float = 1.0,
        retry_cap_s: float = 300.0,
        quiet: QuietHours | None = None,
        broker: BrokerLink | None = None,
    ) -> None:
        self.pool = pool
        self.dsn = dsn
        self.node_id = node_id
        self.topics = topics
        self.publish = publish
        self.metrics = metrics
        self.outbox_metrics = OutboxMetrics.of(metrics.registry)
        self.lease_s = lease_s
        self.batch = batch
        self.poll_s = poll_s
        self.retry_base_s = retry_base_s
        self.retry_cap_s = retry_cap_s
        self.quiet = quiet
        self.broker = broker or BrokerLink()
        self._wakeup = self.broker.wakeup()
        self._backlog_read_at: float | None = None

    @classmethod
    def from_config(
        cls, node: Node, outbox: OutboxConfig, *, quiet: QuietHours | None
    ) -> OutboxPublisher:
        return cls(
            pool=node.pool,
            dsn=node.dsn,
            node_id=node.node_id,
            topics=node.topics,
            publish=node.publish,
            metrics=node.metrics,
            retry_base_s=outbox.retry_min_s,
            retry_cap_s=outbox.retry_max_s,
            quiet=quiet,
            broker=node.broker,
        )

    async def run(self, stop: asyncio.Event) -> None:
        await drain_on_notify(
            dsn=self.dsn,
            channel=NOTIFY_CHANNEL,
            stop=stop,
            step=self.run_once,
            poll_s=self.poll_s,
            name="outbox-publisher",
            wakeup=self._wakeup,
        )

    async def run_once(self) -> int:
        """Claim due events and publish them; the number claimed (0: nothing due, or the
        broker session is down: claims now could only fail). The session is asked first (a
        pass while it is down reads only the backlog) and again inside the connection, right
        before the claim's statement; what is left is the session lost while the statement
        runs (its events are then released)."""
        if not self.broker.up():
            # Nothing is claimed, but the backlog gauges, the signal that events are not
            # going out, follow the backlog the outage builds up.
            if self._backlog_due():
                async with self.pool.acquire() as conn:
                    await self._read_backlog(conn)
            return 0
        # A failed claim raises: the loop retries it with backoff (see gateway.support.loops).
        async with self.pool.acquire() as conn:
            # Asked again, at the last moment before the claim: the wait for a connection (a
            # busy pool) may have outlasted the session. A pass that asked only before it
            # claimed the due events for a broker it could not reach, and released them
            # unpublished at once (their last_error the session's loss, held meanwhile from
            # the nodes whose session was up).
            claimed = (
                await outbox.claim_due(
                    conn, node_id=self.node_id, lease_s=self.lease_s, limit=self.batch
                )
                if self.broker.up()
                else []
            )
            if self._backlog_due():
                await self._read_backlog(conn)
        if claimed:
            outcomes = await asyncio.gather(*(self._publish(event) for event in claimed))
            paired = list(zip(claimed, outcomes, strict=True))
            published = [event for event, outcome in paired if isinstance(outcome, _Sent)]
            reach = {
                event.id: outcome.reached for event, outcome in paired if isinstance(outcome, _Sent)
            }
            await self._release([(e, exc) for e, exc in paired if isinstance(exc, SessionDown)])
            # A delivering event whose publish reached nobody, with no quiet hours to decide,
            # changes no alarm (``deliver`` would find nothing to do): it only informs, and is
            # marked published with the others rather than in a transaction of its own (an
            # alarm storm's creations, 10,000 transactions before).
            pushing: list[ClaimedEvent] = []
            informing: list[ClaimedEvent] = []
            for event in published:
                (pushing if self._decides(event, reach[event.id]) else informing).append(event)
            await self._mark_published(informing)
            # Pushes write the alarm too, one transaction each; a few at a time, so the
            # ingest path always finds a free connection in the pool.
            slots = asyncio.Semaphore(DELIVERY_CONCURRENCY)

            async def push(event: ClaimedEvent) -> None:
                async with slots:
                    await self._push(event, reach[event.id])

            await asyncio.gather(*(push(event) for event in pushing))
        return len(claimed)

    def _backlog_due(self) -> bool:
        last = self._backlog_read_at
        return last is None or asyncio.get_running_loop().time() - last >= BACKLOG_EVERY_S

    async def _read_backlog(self, conn: asyncpg.Connection) -> None:
        backlog, oldest = await outbox.backlog(conn)
        self._backlog_read_at = asyncio.get_running_loop().time()
        self.outbox_metrics.outbox_backlog.set(backlog)
        self.outbox_metrics.outbox_oldest_age.set(oldest)

    def _decides(self, event: ClaimedEvent, reached: str | None) -> bool:
        """Whether publishing this event may change its alarm (see ``_push``)."""
        if event.event_type not in DELIVERING_EVENTS:
            return False
        return reached is not None or self.quiet is not None

    def _body(self, event: ClaimedEvent) -> bytes:
        return msgspec.json.encode(
            {
                "event_id": str(event.event_id),
                "event_type": event.event_type,
                "aggregate_type": event.aggregate_type,
                "aggregate_id": event.aggregate_id,
                "schema_version": event.schema_version,
                "created_at": event.created_at.isoformat(),
                "payload": msgspec.Raw(event.payload.encode()),
            }
        )

    async def _publish(self, event: ClaimedEvent) -> _Sent | Exception:
        """Publish one event: once the broker has it, whom it reached; else the error (a failure
        other than the session's being down is scheduled for retry here)."""
        body = self._body(event)
        try:
            topic = self.topics.event(event.aggregate_type, event.aggregate_id)
        except ValueError as exc:
            # No topic can carry it (an aggregate id the topic rules refuse): it would be
            # refused again at every claim, on every node. DEAD, kept with its reason, rather
            # than an error that stops the publisher (and the daemon) at each claim of it.
            where = f"{self.topics.prefix}/events/{event.aggregate_type}/…"
            await self._dead(
                event, f"BAD_TOPIC: {exc}", where, len(body), setting="none (a fault of ours)"
            )
            return exc
        try:
            code = await self.publish(topic, body)
        except SessionDown as exc:
            return exc  # released with the others (see _release)
        except PublishRefused as exc:
            if exc.final:
                await self._dead(event, f"{exc.reason}: {exc}", topic, len(body))
            else:
                await self._failed(event, exc)
            return exc
        except Exception as exc:  # any other publish failure is retried later, backing off
            await self._failed(event, exc)
            return exc
        if code == PUBACK_SUBSCRIBED:
            return _Sent(f"MQTT: {topic} (PUBACK reason code 0: subscribers)")
        return _Sent(None)

    async def _mark_published(self, events: list[ClaimedEvent]) -> None:
        """Events that only inform: marked published together, in one statement."""
        if not events:
            return
        held = await outbox.mark_published_many(self.pool, [e.id for e in events], self.node_id)
        for event in events:
            if event.id in held:
                self.outbox_metrics.outbox_published.labels(event.event_type).inc()
            else:
                # Our lease ran out and another publisher took the event: it publishes.
                log.info("outbox_lease_lost", event_id=str(event.event_id))

    async def _push(self, event: ClaimedEvent, reached: str | None) -> None:
        """A delivering event: marked published with the alarm's NEW → PUSHED (if ``reached``
        someone) or DELAYED (quiet hours)."""
        async with self.pool.acquire() as conn, conn.transaction():
            if not await outbox.mark_published(conn, event.id, self.node_id):
                log.info("outbox_lease_lost", event_id=str(event.event_id))
                return
            delivered = await deliver(
                conn,
                int(event.aggregate_id),
                quiet=self.quiet,
                node_id=self.node_id,
                reached=reached,
            )
        self.outbox_metrics.outbox_published.labels(event.event_type).inc()
        if delivered is not None:
            self.metrics.count_alarm_transition("NEW", delivered.value)

    async def _release(self, failed: list[tuple[ClaimedEvent, Exception]]) -> None:
        """Due again at once, no retry counted: the session was down (see the module). The
        largest of those in doubt (written, no PUBACK before the end) are counted, and one
        that ended the connection ``IN_DOUBT_LIMIT`` times is DEAD instead."""
        if not failed:
            return
        sizes = {e.id: len(self._body(e)) for e, exc in failed if isinstance(exc, PublishInDoubt)}
        largest = max(sizes.values(), default=None)
        suspects = [e for e, _ in failed if e.id in sizes and sizes[e.id] == largest]
        plain = [e for e, _ in failed if e not in suspects]
        error = repr(failed[0][1])
        log.info("outbox_events_released", events=len(failed), error=error)
        for event in [e for e in suspects if e.in_doubt_count + 1 >= IN_DOUBT_LIMIT]:
            topic = self.topics.event(event.aggregate_type, event.aggregate_id)
            reason = (
                f"CONNECTION_CLOSED: the broker connection ended {IN_DOUBT_LIMIT} times while"
                f" this event ({sizes[event.id]} bytes) was the largest publish awaiting its"
                " PUBACK: the broker closes it for this event (over its maximum packet size?"
                " MQTT 3.1.1 cannot say why)"
            )
            await self._dead(event, reason, topic, sizes[event.id])
        counted = [e for e in suspects if e.in_doubt_count + 1 < IN_DOUBT_LIMIT]
        # Not recorded: the lease runs out and the events are claimed again anyway.
        with contextlib.suppress(*DB_ERRORS):
            if plain:
                await outbox.release(self.pool, [e.id for e in plain], self.node_id, error=error)
            if counted:
                await outbox.release_in_doubt(
                    self.pool, [e.id for e in counted], self.node_id, error=error
                )

    async def _dead(
        self,
        event: ClaimedEvent,
        reason: str,
        topic: str,
        size: int,
        setting: str = "[mqtt] max_packet_size, the broker's message size limit",
    ) -> None:
        self.outbox_metrics.outbox_dead.inc()
        log.error(
            "outbox_event_dead",
            event_id=str(event.event_id),
            event_type=event.event_type,
            topic=topic,
            body_bytes=size,
            reason=reason,
            setting=setting,
        )
        # Not recorded: the lease runs out, the event is claimed again and refused again.
        with contextlib.suppress(*DB_ERRORS):
            async with self.pool.acquire() as conn:
                await outbox.mark_dead(conn, event.id, self.node_id, reason=reason)

    async def _failed(self, event: ClaimedEvent, exc: BaseException) -> None:
        delay = Backoff(self.retry_base_s, self.retry_cap_s, attempt=event.retry_count).next_delay()
        self.outbox_metrics.outbox_failures.inc()
        log.warning(
            "outbox_publish_failed",
            event_id=str(event.event_id),
            error=repr(exc),
            retry_in_s=round(delay, 3),
            retry_count=event.retry_count + 1,
        )
        # Not recorded: the lease runs out and the event is claimed again anyway.
        with contextlib.suppress(*DB_ERRORS):
            async with self.pool.acquire() as conn:
                await outbox.mark_failed(
                    conn, event.id, self.node_id, retry_in_s=delay, error=repr(exc)
                )
