"""Delivery workers: claim with a lease, send holding nothing, finish by a conditional write.

For each receiver a node keeps at most ``concurrency`` deliveries in flight. A pass claims, per
receiver, as many due deliveries as it has free slots (one short statement, ``SKIP LOCKED``:
another node takes others), and sends each in its own task **with no transaction open and no
pooled connection held**, under the receiver's ``timeout_s``. The finishing write names the
lease owner and the attempt: a delivery whose lease ran out and was taken over by another node
keeps what that node does. A failed attempt is retried after a capped exponential backoff with
jitter; after ``max_attempts`` it is ``FAILED`` with its last error. A receiver that hangs fills
only its own slots: other receivers, the outbox publisher and ingest go on.

A delivery of an alarm's event is what reaches a person (docs/behaviour.md §5): the write that
finishes it SENT also pushes the alarm if it is still NEW (the audit note names the receiver),
and the write that finishes it FAILED adds a ``notify_failed`` row to the alarm's audit trail,
with the receiver and the last error, so an operator sees that nobody was reached that way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

import asyncpg
import structlog

from gateway.alarms.delivery import NOTIFY_ACTOR, reached
from gateway.domain.notify import Notify, NotifyConfig, ReceiverConfig
from gateway.notify.metrics import NotifyMetrics
from gateway.notify.receivers import (
    SMTP_LATER_S,
    Accepted,
    Farewell,
    Refusal,
    Sender,
    SendError,
    error_text,
    sender_for,
)
from gateway.support.backoff import Backoff
from gateway.support.loops import (
    RETRYABLE,
    Listener,
    failure_backoff,
    failure_delay,
    sleep_unless_stopped,
    wait_event_or_stop,
)
from gateway.support.metrics import Metrics
from storage import alarms as alarm_repo
from storage import notify as repo
from storage.errors import DB_ERRORS
from storage.notify import ClaimedDelivery

if TYPE_CHECKING:
    import aiohttp  # imported with the first receiver (see gateway.notify.receivers)

log = structlog.get_logger(__name__)

# New deliveries are notified here (a trigger); polling `poll_s` remains the fallback, and
# what retries wait for.
CHANNEL = "notify_delivery"


class DeliveryWorker:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        node_id: str,
        metrics: NotifyMetrics,
        settings: NotifyConfig,
        rules: Notify,
        dsn: str = "",
        alarm_metrics: Metrics | None = None,
    ) -> None:
        self.pool = pool
        # The node's metrics: an alarm this worker pushes counts in gateway_alarm_transitions.
        self.alarm_metrics = alarm_metrics
        self.dsn = dsn
        self.node_id = node_id
        self.metrics = metrics
        self.settings = settings
        self.rules = rules
        self.wakeup = asyncio.Event()
        self.in_flight: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._senders: dict[str, tuple[ReceiverConfig, Sender]] = {}

    def replace(self, settings: NotifyConfig, rules: Notify) -> None:
        """A reload: new receivers and settings for the next claims; sends in flight finish
        with what they started with."""
        self.settings = settings
        self.rules = rules
        self._senders = {
            name: entry
            for name, entry in self._senders.items()
            if rules.receivers.get(name) == entry[0]
        }
        self.wakeup.set()

    def _sender(self, receiver: ReceiverConfig) -> Sender:
        entry = self._senders.get(receiver.name)
        if entry is None or entry[0] != receiver:
            if self._session is None:
                import aiohttp

                # No cap on connections in total (aiohttp's default is 100): receivers that
                # hang would take them all and every other send would queue behind them. Each
                # receiver's slots already bound its sends. And no cookies: the client is
                # shared, and a session one receiver's answer set (say, of a host several
                # receivers share) was sent to every other receiver on that host.
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0),
                    cookie_jar=aiohttp.DummyCookieJar(),
                )
            entry = (receiver, sender_for(receiver, self._session))
            self._senders[receiver.name] = entry
        return entry[1]

    def slots(self, receiver: ReceiverConfig) -> int:
        return receiver.concurrency or self.settings.concurrency

    async def run(self, stop: asyncio.Event) -> None:
        backoff = failure_backoff(self.settings.poll_s)
        # Another node's consumer made deliveries: its NOTIFY wakes this node at once.
        listener = Listener(self.dsn, CHANNEL, self.wakeup, "notify-delivery") if self.dsn else None
        try:
            while not stop.is_set():
                if listener is not None:
                    await listener.ensure()
                # Cleared before the pass: a wake-up during it ends the wait below at once.
                self.wakeup.clear()
                try:
                    if await self.run_once():
                        backoff.reset()
                        continue
                except RETRYABLE as exc:
                    # Never later than the cap, whatever poll_s (as every() retries).
                    delay = failure_delay(self.settings.poll_s, backoff)
                    log.warning("notify_claim_failed", error=repr(exc), retry_in_s=round(delay, 3))
                    await sleep_unless_stopped(stop, delay)
                    continue
                backoff.reset()
                wait_s = self.settings.poll_s
                if listener is not None:
                    wait_s = listener.wait_s(wait_s)
                await wait_event_or_stop(self.wakeup, stop, wait_s)
        finally:
            if listener is not None:
                await listener.close()
            await self.close()

    async def close(self) -> None:
        """Stop: sends in flight are cancelled (their leases run out; another pass resends)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run_once(self) -> int:
        """Claim what the free slots allow and start sending; the number claimed."""
        settings = self.settings
        receivers: Mapping[str, ReceiverConfig] = self.rules.receivers
        claimed: list[tuple[ReceiverConfig, ClaimedDelivery]] = []
        async with self.pool.acquire() as conn:
            for receiver in receivers.values():
                free = self.slots(receiver) - self.in_flight.get(receiver.name, 0)
                if free <= 0:
                    continue
                for delivery in await repo.claim_due(
                    conn,
                    receiver=receiver.name,
                    node_id=self.node_id,
                    lease_s=settings.lease_s,
                    limit=min(free, settings.batch),
                ):
                    claimed.append((receiver, delivery))
            pending, oldest = await repo.pending_stats(conn)
        self.metrics.pending.set(pending)
        self.metrics.oldest_pending_age.set(oldest)
        for receiver, delivery in claimed:
            self._start(receiver, delivery)
        return len(claimed)

    def _start(self, receiver: ReceiverConfig, delivery: ClaimedDelivery) -> None:
        self.in_flight[receiver.name] = self.in_flight.get(receiver.name, 0) + 1
        self.metrics.in_flight.labels(receiver.name).inc()
        task = asyncio.create_task(
            self.deliver(receiver, delivery), name=f"notify-{receiver.name}-{delivery.id}"
        )
        self._tasks.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self._tasks.discard(finished)
            self.in_flight[receiver.name] -= 1
            self.metrics.in_flight.labels(receiver.name).dec()
            self.wakeup.set()  # a slot is free

        task.add_done_callback(done)

    async def deliver(self, receiver: ReceiverConfig, delivery: ClaimedDelivery) -> None:
        """Send one claimed delivery and record the outcome."""
        error: str | None = None
        accepted: Accepted | None = None
        asked_s: float | None = None
        refusal = Refusal()
        try:
            # No transaction, no pooled connection: a hanging receiver holds only its slot.
            async with asyncio.timeout(receiver.timeout_s):
                accepted = await self._sender(receiver).send(delivery, refusal)
        except SendError as exc:
            error = str(exc) or type(exc).__name__
            asked_s = exc.retry_after_s
        except TimeoutError:
            if refusal.status:
                # Refused, and its body still coming at the timeout: the refusal it is.
                late = refusal.error(receiver, f" (its body cut off at {receiver.timeout_s} s)")
                error, asked_s = str(late), late.retry_after_s
            else:
                error = f"no answer within {receiver.timeout_s} s"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            # Whatever the text came from (an answer echoing our request, an exception quoting
            # the URL), it is shown to every viewer and logged: no credential stays in it.
            error = error_text(receiver, error)
        farewell: Farewell | None = None
        if accepted is not None:
            farewell = accepted.farewell
            if accepted.refused:
                # Taken for some recipients, refused for others: the delivery says whom it
                # missed, as the log does (those refused for now are mailed again).
                log.warning(
                    "notify_recipients_refused",
                    delivery_id=delivery.id,
                    receiver=receiver.name,
                    refused=sorted(accepted.refused),
                    later=sorted(accepted.later),
                    error=error_text(receiver, "refused recipients: " + _parts(accepted.refused)),
                )
        try:
            await self._finish(receiver, delivery, error, accepted=accepted, asked_s=asked_s)
        except DB_ERRORS as exc:
            # Not recorded: the lease runs out and the delivery is claimed (and sent) again.
            log.warning("notify_finish_failed", delivery_id=delivery.id, error=repr(exc))
        finally:
            if farewell is not None:
                # Once the outcome is recorded and outside the attempt's timeout (an SMTP
                # QUIT): nothing it does makes the delivery a failed attempt.
                await farewell()

    async def _failed(
        self, conn: asyncpg.Connection, delivery: ClaimedDelivery, name: str, error: str
    ) -> None:
        """What a delivery FAILED means besides its status: each alarm's audit trail; and
        for a group's window (its group repeats nothing until a new window), the groups of
        its route that left its alarms to it remind of them again."""
        for alarm_id in await self._alarms(conn, delivery):
            await self._audit_failed(conn, alarm_id, name, error)
        if delivery.group_id is not None:
            await repo.wake_deferring_groups(conn, delivery.id)

    async def _finish(
        self,
        receiver: ReceiverConfig,
        delivery: ClaimedDelivery,
        error: str | None,
        *,
        accepted: Accepted | None = None,
        asked_s: float | None = None,
    ) -> None:
        """Record the attempt's outcome. ``asked_s``: how long a refusing receiver asked to be
        left alone (``Retry-After``), the least a retry then waits. ``accepted``: what the
        receiver took, with the recipients it refused (for good, or for now: ``later``)."""
        name = receiver.name
        last = delivery.attempts >= self.settings.max_attempts
        refused = dict(accepted.refused) if accepted is not None else {}
        later = accepted.later if accepted is not None else ()
        # Refused for good, at this attempt and at those before it: not mailed again.
        for_good = _joined(
            delivery.recipients_missed,
            _parts({a: why for a, why in refused.items() if a not in later}),
        )
        if error is None and later and not last:
            # Some recipients took it, others were refused for now (a greylisting 451): the
            # alarm is reached, and the delivery waits for the next attempt, for those alone.
            outcome = await self._finish_partly(receiver, delivery, refused, later, for_good)
        elif error is None:
            # Taken by everyone still owed it, or by some of them with no attempt left for
            # the others: SENT, naming whom it missed.
            missed = _joined(for_good, _parts({a: refused[a] for a in later}))
            outcome = await self._finish_sent(receiver, delivery, missed)
        elif last and delivery.recipients_owed is not None:
            # The last attempt failed, but someone took the mail at an earlier one: SENT too.
            owed = ", ".join(delivery.recipients_owed)
            outcome = await self._finish_sent(
                receiver, delivery, _joined(for_good, f"{owed}: {error}")
            )
        elif last:
            async with self.pool.acquire() as conn, conn.transaction():
                held = await repo.finish_failed(
                    conn, delivery.id, self.node_id, delivery.attempts, error=error
                )
                if held:
                    await self._failed(conn, delivery, name, error)
            outcome = "FAILED" if held else "LEASE_LOST"
            if held:
                log.warning(
                    "notify_delivery_failed",
                    delivery_id=delivery.id,
                    receiver=name,
                    attempts=delivery.attempts,
                    error=error,
                )
        else:
            delay = retry_delay(self.settings, delivery.attempts, asked_s)
            held = await repo.finish_retry(
                self.pool,
                delivery.id,
                self.node_id,
                delivery.attempts,
                retry_in_s=delay,
                error=error,
            )
            outcome = "RETRY" if held else "LEASE_LOST"
            if held:
                log.info(
                    "notify_attempt_failed",
                    delivery_id=delivery.id,
                    receiver=name,
                    attempt=delivery.attempts,
                    retry_in_s=round(delay, 3),
                    error=error,
                )
        if outcome == "LEASE_LOST":
            log.info("notify_lease_lost", delivery_id=delivery.id, receiver=name)
        self.metrics.deliveries.labels(name, outcome).inc()

    async def _finish_sent(
        self, receiver: ReceiverConfig, delivery: ClaimedDelivery, missed: str
    ) -> str:
        """SENT, its alarms pushed; ``missed`` (recipients refused, and why) its last error.
        The outcome counted."""
        text = error_text(receiver, f"refused recipients: {missed}") if missed else None
        pushed: list[int] = []
        async with self.pool.acquire() as conn, conn.transaction():
            latency_s = await repo.finish_sent(
                conn, delivery.id, self.node_id, delivery.attempts, missed=text
            )
            if latency_s is not None:
                pushed = await self._reach(conn, receiver, delivery)
        if latency_s is not None:
            self._reached(receiver, delivery, pushed, latency_s)
        return "SENT" if latency_s is not None else "LEASE_LOST"

    async def _finish_partly(
        self,
        receiver: ReceiverConfig,
        delivery: ClaimedDelivery,
        refused: Mapping[str, str],
        later: tuple[str, ...],
        for_good: str,
    ) -> str:
        """An e-mail some recipients took and ``later`` were refused for now: its alarms are
        pushed, and it is PENDING again for ``later`` alone. The outcome counted."""
        delay = retry_delay(self.settings, delivery.attempts, SMTP_LATER_S)
        pushed: list[int] = []
        async with self.pool.acquire() as conn, conn.transaction():
            latency_s = await repo.finish_partly(
                conn,
                delivery.id,
                self.node_id,
                delivery.attempts,
                retry_in_s=delay,
                owed=later,
                missed=error_text(receiver, for_good) or None,
                error=error_text(receiver, "refused recipients: " + _parts(refused)),
            )
            if latency_s is not None:
                pushed = await self._reach(conn, receiver, delivery)
        if latency_s is None:
            return "LEASE_LOST"
        self._reached(receiver, delivery, pushed, latency_s)
        log.info(
            "notify_recipients_later",
            delivery_id=delivery.id,
            receiver=receiver.name,
            recipients=list(later),
            attempt=delivery.attempts,
            retry_in_s=round(delay, 3),
        )
        return "RETRY"

    async def _reach(
        self, conn: asyncpg.Connection, receiver: ReceiverConfig, delivery: ClaimedDelivery
    ) -> list[int]:
        """The receiver took the delivery (in the transaction recording it): its alarms still
        NEW are pushed; the ids pushed."""
        what = "grouped delivery" if delivery.group_id is not None else "delivery"
        pushed: list[int] = []
        for alarm_id in await self._alarms(conn, delivery):
            if await reached(
                conn,
                alarm_id,
                via=f"{receiver.kind} receiver {receiver.name} ({what} {delivery.id})",
                node_id=self.node_id,
            ):
                pushed.append(alarm_id)
        return pushed

    def _reached(
        self,
        receiver: ReceiverConfig,
        delivery: ClaimedDelivery,
        pushed: list[int],
        latency_s: float,
    ) -> None:
        """Once recorded: the pushes logged and counted, and the delivery's latency (from its
        event's creation, on the database's clock: a node whose own clock is minutes off
        measured every delivery it sent minutes late, or at 0), measured to the first
        acceptance (not again at a later attempt for recipients still owed)."""
        for alarm_id in pushed:
            log.info("alarm_reached", alarm_id=alarm_id, receiver=receiver.name)
            if self.alarm_metrics is not None:
                self.alarm_metrics.count_alarm_transition("NEW", "PUSHED")
        if delivery.recipients_owed is None:
            self.metrics.latency.labels(receiver.name).observe(max(0.0, latency_s))

    async def _alarms(self, conn: asyncpg.Connection, delivery: ClaimedDelivery) -> list[int]:
        """The alarms a delivery carries: its own, or every one of its window's."""
        if delivery.group_id is not None:
            return await repo.delivery_alarms(conn, delivery.id)
        return [] if delivery.alarm_id is None else [delivery.alarm_id]

    async def _audit_failed(
        self, conn: asyncpg.Connection, alarm_id: int, receiver: str, error: str
    ) -> None:
        """The alarm's audit trail shows the delivery that reached nobody; its status stays."""
        record = await alarm_repo.get(conn, alarm_id)
        if record is None:
            return
        await alarm_repo.insert_audit(
            conn,
            alarm_id=alarm_id,
            actor=NOTIFY_ACTOR,
            action="notify_failed",
            from_status=record["status"],
            to_status=record["status"],
            node_id=self.node_id,
            note=f"notification failed: receiver {receiver}: {error}",
        )


def _parts(refused: Mapping[str, str]) -> str:
    """Refused recipients as ``address: answer; ...``."""
    return "; ".join(f"{address}: {why}" for address, why in refused.items())


def _joined(*parts: str | None) -> str:
    return "; ".join(part for part in parts if part)


def retry_delay(settings: NotifyConfig, attempts: int, asked_s: float | None) -> float:
    """Seconds before the next attempt of a delivery that failed its ``attempts``-th: the
    backoff's, or what the receiver asked for (``Retry-After``: a rate limit, a maintenance)
    if longer, up to ``backoff_max_s``. Retried sooner, the attempts were spent inside the
    receiver's window and the delivery ended FAILED."""
    delay = Backoff(settings.backoff_min_s, settings.backoff_max_s, attempt=attempts - 1)
    backoff = delay.next_delay()
    if asked_s is None:
        return backoff
    return max(backoff, min(asked_s, settings.backoff_max_s))
