"""The ingest pipeline: reader → bounded queue → batch → one transaction → acknowledgements.

A message is acknowledged to the broker only after the transaction that stored it (or its
dead letter) committed. Until then it counts against the broker's window of unacked
messages, which is what bounds memory: when the database is slow or down, the queue fills,
the reader blocks, the window fills and the broker stops sending."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections import deque
from collections.abc import AsyncIterator, Sequence

import asyncpg
import structlog

from gateway.alarms.engine import AlarmEngine
from gateway.commands.receipts import ReceiptApplier
from gateway.config import DatabaseConfig, IngestConfig
from gateway.domain.errors import ConcurrentWriteError
from gateway.ingest.breaker import QUARANTINED, CrashLoopBreaker
from gateway.ingest.decoder import (
    PROCESSING_FAILED,
    Classified,
    Inbound,
    MessageDecoder,
    failure_detail,
)
from gateway.ingest.flights import Flight, plan
from gateway.ingest.mapping_memory import MappingMemory
from gateway.ingest.metrics import IngestMetrics
from gateway.ingest.store import StoreResult, store
from gateway.sparkplug.host import SparkplugHost
from gateway.sparkplug.metrics import SparkplugMetrics
from gateway.support.backoff import Backoff
from gateway.support.metrics import Metrics, observe_many
from gateway.support.node import Node
from storage import ingest as repo
from storage.errors import DB_ERRORS, TRANSIENT_DB_ERRORS
from storage.ingest import DeadLetterRow, Xact
from storage.pool import describe

log = structlog.get_logger(__name__)

# Reason codes of dead letters, beyond the decoder's OVERSIZED / MALFORMED / INVALID and the
# topic parser's BAD_TOPIC / BAD_DEVICE_ID.
STORAGE_REJECTED = "STORAGE_REJECTED"

# Errors after which the same transaction may succeed later: the database is away (see
# storage.errors), or another node raised the same alarm first. Anything else is about the data.
RETRY_LATER: tuple[type[BaseException], ...] = (*TRANSIENT_DB_ERRORS, ConcurrentWriteError)


# The driver refusing a value before it reaches the server (out of a column type's range, say):
# about the data, never transient, though asyncpg derives it from InterfaceError.
REFUSED_DATA: tuple[type[BaseException], ...] = (asyncpg.exceptions.DataError,)

# A batch that holds this many messages starts at once when no other transaction is in
# flight, whatever is left of ``[ingest] linger_ms``: the database would otherwise sit idle
# while messages wait, and at high rates every batch paid that idle time again (publish to
# commit at 8,000 msg/s, eight alternated pairs: p99 median 62.5 -> 55.9 ms, p50 23.9 -> 20.0;
# docs/performance.md, "Lingering while the database waits"). Below it a transaction costs
# more than the wait saves: starting every batch at once, the machine spent about a fifth
# more CPU at 2,000 msg/s; with this it spends what the full linger did.
START_AT = 16

# How long a batch whose COMMIT answer was lost waits for PostgreSQL to finish its transaction
# (pg_xact_status 'in progress') before storing it again.
COMMIT_STATUS_WAIT_S = 60.0


def _tasks(flights: Sequence[Flight[Inbound]]) -> list[asyncio.Task[None]]:
    return [f.task for f in flights if f.task is not None]


def refusal_reason(exc: BaseException) -> str:
    """The dead-letter reason of a message whose storing raised ``exc`` (not a transient
    error): the database refused it, or processing it failed (a bug)."""
    refused = isinstance(exc, (asyncpg.PostgresError, *REFUSED_DATA))
    return STORAGE_REJECTED if refused else PROCESSING_FAILED


class IngestWriter:
    """Batches queued messages, stores each batch in one transaction, then acknowledges it.

    One writer per node, so batches commit and are acknowledged in the order they were read
    (MQTT wants PUBACKs in delivery order). Reading overlaps with the commit of the previous
    batch through the bounded queue.
    """

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        decoder: MessageDecoder,
        node_id: str,
        metrics: Metrics,
        batch_size: int,
        linger_s: float,
        queue_max: int,
        retry: Backoff,
        engine: AlarmEngine | None = None,
        receipts: ReceiptApplier | None = None,
        refused_batch_attempts: int = 5,
        database: str = "",
        breaker: CrashLoopBreaker | None = None,
        sparkplug: SparkplugHost | None = None,
        in_flight: int = 2,
    ) -> None:
        self.pool = pool
        # Judges the batches' Sparkplug messages ([sparkplug] enabled; None: off).
        self.sparkplug = sparkplug
        self.sparkplug_metrics = SparkplugMetrics.of(metrics.registry)
        self.breaker = breaker
        # Where the pool points (host:port/name), for the lines saying it is out of reach.
        self.database = database
        # Applies receipts in a batch's transaction; counted by the writer after its commit
        # (a probe's transaction, always rolled back, counts nothing).
        self.receipts = receipts
        self.refused_batch_attempts = refused_batch_attempts
        self.decoder = decoder
        self.node_id = node_id
        self.metrics = metrics
        self.ingest_metrics = IngestMetrics.of(metrics.registry)
        self.batch_size = batch_size
        self.linger_s = linger_s
        self.retry = retry
        self.engine = engine
        # What this node recorded of its mapped devices: a batch records only what is due.
        self.mapping_memory = MappingMemory()
        self.queue: asyncio.Queue[Inbound] = asyncio.Queue(maxsize=queue_max)
        self.last_progress = 0.0
        # The database calls of the writer under way, with when each began (the watchdog
        # reads the oldest: ``in_db_call_since``).
        self._db_calls: dict[object, float] = {}
        self.stored_total = 0
        # Transactions open at once on distinct devices (gateway.ingest.flights), and the
        # acknowledgement sequencer: every message taken from the queue and not yet
        # acknowledged, in delivery order, and for each whose flight landed, whether stored.
        self.in_flight = in_flight
        self._flights: list[Flight[Inbound]] = []
        # The flight of a batch holding a suspect, while it flies: nothing starts beside it.
        self._alone: Flight[Inbound] | None = None
        self._order: deque[Inbound] = deque()
        self._settled: dict[int, bool] = {}
        # Journal writes of concurrent flights, one at a time, each with all that flies.
        self._journal_lock = asyncio.Lock()
        # Set when a flight lands, or the queue holds what fills the lingering batch
        # (``_wake_at`` messages) or is full: a lingering batch looks again.
        self._wake = asyncio.Event()
        self._wake_at = batch_size
        # Every message handed over and not yet released, as the reader's chunks in delivery
        # order: when each chunk was received and how many of it are left. Its oldest is what
        # the node holds unstored longest (``unstored_since``): the node's hearing stops there.
        self._held_at: deque[float] = deque()
        self._held_left: deque[int] = deque()

    @classmethod
    def from_config(
        cls,
        node: Node,
        ingest: IngestConfig,
        database: DatabaseConfig,
        *,
        decoder: MessageDecoder,
        engine: AlarmEngine,
        receipts: ReceiptApplier,
        batch_size: int,
        sparkplug: SparkplugHost | None = None,
        in_flight: int = 2,
    ) -> IngestWriter:
        return cls(
            pool=node.pool,
            decoder=decoder,
            node_id=node.node_id,
            metrics=node.metrics,
            batch_size=batch_size,
            linger_s=ingest.linger_ms / 1000,
            queue_max=ingest.queue_max,
            retry=Backoff(database.retry_min_s, database.retry_max_s),
            engine=engine,
            receipts=receipts,
            refused_batch_attempts=ingest.refused_batch_attempts,
            database=describe(node.dsn),
            breaker=CrashLoopBreaker(node.node_id),
            sparkplug=sparkplug,
            in_flight=in_flight,
        )

    async def put_many(self, items: Sequence[Inbound]) -> None:
        """Queue each, in order, waiting only when the queue is full: overload slows the
        reader, never grows memory."""
        queue = self.queue
        inflight = self.ingest_metrics.inflight
        inflight.inc(len(items))
        if items:
            # Received in delivery order (a reader's chunk shares one arrival time): the
            # first is the chunk's oldest.
            self._held_at.append(items[0].received_at)
            self._held_left.append(len(items))
        for item in items:
            if queue.full():
                self._wake.set()
                try:
                    await queue.put(item)
                except asyncio.CancelledError:
                    # The reader's connection ended: this one and the rest are left
                    # unacknowledged (the broker delivers them again), not in flight.
                    held = next(i for i, x in enumerate(items) if x is item)
                    inflight.dec(len(items) - held)
                    self._held_left[-1] -= len(items) - held
                    if not self._held_left[-1]:
                        self._held_at.pop()
                        self._held_left.pop()
                    raise
            else:
                queue.put_nowait(item)
        if queue.qsize() >= self._wake_at or queue.full():
            self._wake.set()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every queued message is stored and acknowledged (False on timeout)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.queue.join()
        except TimeoutError:
            return False
        return True

    async def recover(self) -> None:
        """At start, before the first batch: what the node was storing when it last died
        (the crash-loop breaker, see breaker.py)."""
        if self.breaker is not None:
            async with self.pool.acquire() as conn:
                await self.breaker.recover(conn)

    async def excuse_in_flight(self, timeout_s: float) -> bool:
        """A database call of this writer has not returned for longer than the watchdog
        allows, and the service manager is about to restart the node: the messages in flight
        are not to blame, so the crash-loop breaker must not count the restart as their death
        (two such restarts would quarantine healthy messages while a lock or a synchronous
        standby holds the database). Whether that could be written within ``timeout_s``, on
        a connection of its own (cut, not released, if the database does not answer)."""
        if self.breaker is None:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self.pool.acquire()
                try:
                    await self.breaker.excuse(conn)
                except asyncio.CancelledError:
                    conn.terminate()
                    raise
                finally:
                    await self.pool.release(conn)
        except DB_ERRORS as exc:
            log.warning("ingest_excuse_failed", error=repr(exc))
            return False
        return True

    async def stopped_cleanly(self) -> None:
        """After the last batch of a clean stop: nothing of this node is in flight."""
        if self.breaker is not None:
            async with self.pool.acquire() as conn:
                await self.breaker.clean_stop(conn)

    async def run(self) -> None:
        """Take batches from the queue and store them, up to ``in_flight`` transactions at
        once on distinct devices (``gateway.ingest.flights``); acknowledge every message in
        the order it was delivered, each after the commit that stored it."""
        flights = self._flights
        waiting: list[Inbound] = []
        try:
            while True:
                # Room for another flight, and, for messages held back, something landed.
                while flights and (waiting or len(flights) >= self.in_flight):
                    await asyncio.wait(_tasks(flights), return_when=asyncio.FIRST_COMPLETED)
                    if waiting:
                        break
                if waiting:
                    taken = self._take_now(self.batch_size - len(waiting))
                else:
                    taken = await self._next_batch()
                self._order.extend(taken)
                batch = waiting + taken
                breaker = self.breaker
                alone = breaker is not None and breaker.isolating(batch)
                if alone or self._alone is not None:
                    # Suspects are stored alone, each in its own transaction: nothing beside
                    # (a death then points at the suspect, not at another flight's messages).
                    while flights:
                        await asyncio.wait(_tasks(flights))
                flight: Flight[Inbound] | None
                if alone:
                    flight, waiting = Flight[Inbound](batch, None), []
                    self._alone = flight
                else:
                    flight, waiting = plan(batch, self.decoder.order_key, flights)
                if flight is not None:
                    flight.started_at = asyncio.get_running_loop().time()
                    flight.task = asyncio.create_task(self._fly(flight))
                    flights.append(flight)
        finally:
            tasks = _tasks(flights)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _fly(self, flight: Flight[Inbound]) -> None:
        stored = False
        try:
            await self._handle(flight.items, dataclasses.replace(self.retry, attempt=0))
            stored = True
        except Exception:
            # Every message's failure is caught where it happens (decoding, storing); this
            # is a bug around them. The flight stays unacknowledged (the broker delivers it
            # again after a reconnect), and the node goes on with the next one.
            log.exception("ingest_batch_failed", size=len(flight.items))
        finally:
            self._land(flight)
            self.ingest_metrics.commit_seconds.observe(
                asyncio.get_running_loop().time() - flight.started_at
            )
            self.metrics.batch_size.observe(len(flight.items))
            settled = self._settled
            for item in flight.items:
                settled[id(item)] = stored
            self._release()

    def _land(self, flight: Flight[Inbound]) -> None:
        """``flight`` is over: out of the flights, and a lingering batch looks again."""
        self._flights.remove(flight)
        if flight is self._alone:
            self._alone = None
        self._wake.set()

    def _release(self) -> None:
        """Acknowledge, in delivery order, every message whose flight has landed and that
        no earlier message still waits for."""
        order, settled = self._order, self._settled
        if not order or id(order[0]) not in settled:
            return
        done = asyncio.get_running_loop().time()
        skipped = released = 0
        latencies: dict[float, int] = {}  # a reader's chunk shares one arrival time
        queue = self.queue
        while order and id(order[0]) in settled:
            item = order.popleft()
            stored = settled.pop(id(item))
            released += 1
            if stored and item.acker is not None:
                if not item.acker.ack(item.message):
                    skipped += 1
                latencies[item.received_at] = latencies.get(item.received_at, 0) + 1
            queue.task_done()
        self.ingest_metrics.inflight.dec(released)
        self._unhold(released)
        if skipped:
            self.ingest_metrics.acks_skipped.inc(skipped)
        for received_at, count in latencies.items():
            observe_many(self.ingest_metrics.handler_seconds, done - received_at, count)
        self.last_progress = done

    def _unhold(self, released: int) -> None:
        """The oldest ``released`` messages handed over are no longer held."""
        held_at, held_left = self._held_at, self._held_left
        while released and held_left:
            if held_left[0] > released:
                held_left[0] -= released
                return
            released -= held_left.popleft()
            held_at.popleft()

    @property
    def unstored_since(self) -> float | None:
        """When the oldest message the node holds unstored was received (the loop's clock;
        None: it holds none): handed over by the reader, queued, or in a flight, until its
        flight lands and everything delivered before it has too. What the node heard since
        is not known yet: a device whose message waits here is not silent."""
        held_at = self._held_at
        return held_at[0] if held_at else None

    @property
    def in_db_call_since(self) -> float | None:
        """Since when the oldest database call of the writer under way has been waiting
        (None: none is): a call that never returns (a lock, a black-holed connection) is
        what "stuck" means to the watchdog. Failing fast and retrying is not stuck."""
        calls = self._db_calls
        return min(calls.values()) if calls else None

    def _take_now(self, limit: int) -> list[Inbound]:
        """Up to ``limit`` queued messages, without waiting."""
        queue = self.queue
        taken: list[Inbound] = []
        while len(taken) < limit and not queue.empty():
            taken.append(queue.get_nowait())
        return taken

    async def _next_batch(self) -> list[Inbound]:
        """The next batch: what is queued, waiting up to ``linger_s`` from its first message
        for more. It stops waiting once it is full, or once it holds ``START_AT`` messages
        while no other transaction is in flight; while one is, it waits for it to land (or the
        linger to end), taking what arrived meanwhile."""
        queue = self.queue
        batch = [await queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.linger_s
        while True:
            batch.extend(self._take_now(self.batch_size - len(batch)))
            remaining = deadline - loop.time()
            if len(batch) >= self.batch_size or remaining <= 0:
                return batch
            if self._flights:
                # Woken when a flight lands or the queue fills the batch (put_many).
                self._wake_at = self.batch_size - len(batch)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._wake.wait()
                continue
            if len(batch) >= START_AT:
                return batch
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    batch.append(await queue.get())

    async def _handle(self, batch: list[Inbound], retry: Backoff) -> None:
        """Store ``batch`` (its suspects alone, its quarantined messages as dead letters)."""
        quarantined: list[Inbound] = []
        groups = [batch]
        if self.breaker is not None:
            # Journaled before it is decoded: decoding runs C extensions (JSON, Sparkplug's
            # protobuf) on what devices sent, and a message that kills the process there must
            # count its deaths like one that kills it while stored. The journal's answer is
            # what the fleet counted of these messages (another node's deaths, a quarantine)
            # since this node started: the batch is split by it.
            await self._journal(batch, retry)
            quarantined, groups = self.breaker.split(batch)
        # The batch is stored as journaled, or each group is journaled before its turn.
        regroup = len(groups) != 1 or len(groups[0]) != len(batch)
        letters = self._quarantine(quarantined)
        for index, group in enumerate(groups or [[]]):
            # The quarantined messages' dead letters commit with the first group.
            carried = letters if index == 0 else []
            if regroup:
                await self._journal(group, retry)
            classified = self.decoder.classify(group)
            classified.dead_letters.extend(carried)
            result = await self.store_with_retry(
                classified,
                carried=carried,
                settled=quarantined if index == 0 else [],
                retry=retry,
            )
            self._count(result, classified, received=len(classified.telemetry_sources))

    def _quarantine(self, items: list[Inbound]) -> list[DeadLetterRow]:
        letters = []
        for item in items:
            assert self.breaker is not None
            # Whole, whatever [ingest] dead_letter_max_bytes: it was taken whole to be
            # processed, and only a successful replay of its letter releases the message (cut
            # down, the letter was `truncated`, never replayable: the same bytes quarantined
            # at every arrival for good).
            letter = self.decoder.dead_letter(
                item, QUARANTINED, self.breaker.quarantine_detail(item), whole=True
            )
            log.error(
                "message_quarantined",
                topic=item.topic,
                payload_sha256=letter.payload_sha256,
                deaths=self.breaker.deaths(item),
            )
            letters.append(letter)
        return letters

    def _count(self, result: StoreResult, batch: Classified, *, received: int) -> None:
        m = self.ingest_metrics
        m.telemetry_received.inc(received)
        m.telemetry_stored.inc(result.stored)
        m.telemetry_duplicates.inc(result.duplicates)
        m.presence_updates.inc(result.presence)
        if batch.retained_copies:
            m.retained_copies.inc(batch.retained_copies)
        for kind, count in batch.empty.items():
            m.empty_messages.labels(kind).inc(count)
        outcome = result.sparkplug
        if outcome is not None:
            sm = self.sparkplug_metrics
            for message in batch.sparkplug:
                sm.messages.labels(message.topic.type.value).inc()
            if outcome.duplicates:
                sm.duplicates.inc(outcome.duplicates)
            if outcome.distrusted:
                sm.distrusted.inc(len(outcome.distrusted))
        for letter in result.dead_letters:
            self.metrics.dead_letters.labels(letter.reason).inc()
            log.warning(
                "message_dead_lettered",
                topic=letter.topic,
                reason=letter.reason,
                detail=letter.detail,
                payload_bytes=letter.payload_size,
                payload_sha256=letter.payload_sha256,
                truncated=letter.truncated,
            )

    async def store_with_retry(
        self,
        batch: Classified,
        *,
        carried: Sequence[DeadLetterRow] = (),
        settled: Sequence[Inbound] = (),
        retry: Backoff | None = None,
    ) -> StoreResult:
        """Commit the batch, retrying for as long as the database is unreachable.

        A batch the database refuses for its content (say, a string PostgreSQL cannot hold)
        would otherwise be retried forever: each of its messages is tried alone, and those
        refused on their own become dead letters, so one bad message never blocks the ones
        behind it, and the others — command receipts and presence included — are stored as
        usual. A refusal no single message explains (it needs several of them, or comes from
        the database itself) is retried with backoff ``refused_batch_attempts`` times; then
        every message of the batch is dead-lettered rather than blocking the pipeline.

        An exception that is not the database's (a bug in decoding, rules or receipts, set
        off by one message) is handled the same way: the message that raises it alone
        becomes a dead letter, ``PROCESSING_FAILED``, and the rest are stored. ``carried``
        are dead letters decided before (the quarantined messages, ``settled``), kept
        through every split.
        """
        retry = self.retry if retry is None else retry
        refused: list[DeadLetterRow] = list(carried)  # messages dead-lettered on the way
        unexplained = 0
        while True:
            try:
                result = await self._store_once(batch, settled, retry)
            except RETRY_LATER as exc:
                await self._database_away(exc, retry)
                continue
            except Exception as exc:
                if refusal_reason(exc) == STORAGE_REJECTED:
                    log.error("batch_refused_by_database", error=repr(exc), size=len(batch.items))
                else:
                    log.error("batch_processing_failed", error=repr(exc), size=len(batch.items))
                kept, rejected = await self._isolate_refused(batch.items, retry)
                if rejected:
                    self.ingest_metrics.batch_refusals.labels("true").inc()
                    refused.extend(rejected)
                    batch = self._rebuild(kept, refused)
                    continue
                unexplained += 1
                self.ingest_metrics.batch_refusals.labels("false").inc()
                if unexplained >= self.refused_batch_attempts and batch.items:
                    detail = (
                        f"the batch was refused {unexplained} times though no message of it "
                        f"is refused on its own: {exc}"
                    )
                    log.error(
                        "batch_dead_lettered",
                        attempts=unexplained,
                        error=repr(exc),
                        size=len(batch.items),
                    )
                    refused.extend(self._dead_letter_all(batch.items, detail))
                    batch = self._rebuild([], refused)
                    continue
                # Nothing left to split: only the dead letters themselves are refused, and
                # retrying (with backoff) is all there is.
                delay = retry.next_delay()
                log.warning(
                    "batch_refusal_unexplained",
                    attempt=unexplained,
                    error=repr(exc),
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            retry.reset()
            return result

    def _rebuild(self, items: list[Inbound], refused: list[DeadLetterRow]) -> Classified:
        batch = self.decoder.classify(items)
        batch.dead_letters.extend(refused)
        return batch

    def _dead_letter_all(self, items: list[Inbound], detail: str) -> list[DeadLetterRow]:
        """Every message as a dead letter: what the decoder said of it, or the refusal."""
        letters: list[DeadLetterRow] = []
        for item in items:
            verdict = self.decoder.classify([item])
            if verdict.empty:
                continue  # zero bytes: nothing of it was refused (counted with its batch)
            letters.extend(
                verdict.dead_letters or [self.decoder.dead_letter(item, STORAGE_REJECTED, detail)]
            )
        return letters

    @contextlib.asynccontextmanager
    async def _connection(self, *, counted: bool = True) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection for one database call of the writer: the watchdog sees the
        call under way until it ends (``in_db_call_since``), and, ``counted``, its round trips
        are counted as asyncpg sends them (its query logger, which it calls soon after each
        statement: BEGIN and COMMIT included)."""
        call = object()
        self._db_calls[call] = asyncio.get_running_loop().time()
        try:
            async with self.pool.acquire() as conn:
                if not counted:
                    yield conn
                    return
                conn.add_query_logger(self._count_statement)
                try:
                    yield conn
                except BaseException:
                    # A connection that died under the call is already released with its
                    # socket, and asyncpg refuses any call on it: that refusal must not
                    # replace the error that ended the call (the one logged and judged).
                    with contextlib.suppress(asyncpg.InterfaceError):
                        conn.remove_query_logger(self._count_statement)
                    raise
                conn.remove_query_logger(self._count_statement)
        finally:
            del self._db_calls[call]

    async def _journal(self, items: list[Inbound], retry: Backoff) -> None:
        """Before ``items`` are decoded and stored: the breaker's journal holds them and every
        message in flight beside them, committed (tried again while the database is away).
        Their batch is then stored without writing the journal again, retries included: the
        journal holds them until one written after it does too (another flight's journal
        holds every flight not landed)."""
        breaker = self.breaker
        if breaker is None:
            return
        while True:
            try:
                async with self._connection() as conn, self._journal_lock:
                    await breaker.journal(conn, self._in_flight_items(items))
            except RETRY_LATER as exc:
                # Out of the call first: waiting to try again is not a call under way.
                await self._database_away(exc, retry)
            else:
                return

    async def _database_away(self, exc: BaseException, retry: Backoff) -> None:
        """After a call failed with ``exc`` (one of ``RETRY_LATER``): wait before trying again."""
        delay = retry.next_delay()
        self.metrics.db_retries.inc()
        log.warning(
            "database_unavailable",
            database=self.database,
            error=repr(exc),
            # What asyncpg was handling when it raised `exc`: closing a transaction on a
            # connection that died says only that it is closed; this says how it died.
            during=None if exc.__context__ is None else repr(exc.__context__),
            retry_in_s=round(delay, 3),
        )
        await asyncio.sleep(delay)

    async def _store_once(
        self, batch: Classified, settled: Sequence[Inbound], retry: Backoff
    ) -> StoreResult:
        breaker = self.breaker
        sent: StoreResult | None = None  # what the transaction wrote, once its COMMIT is sent
        try:
            async with self._connection() as conn:
                async with conn.transaction():
                    sent = await store(
                        conn,
                        batch,
                        self.node_id,
                        self.engine,
                        self.receipts,
                        sparkplug=self.sparkplug,
                        mappings=self.mapping_memory,
                    )
                if breaker is not None:
                    await breaker.settled(conn, [*batch.items, *settled])
            result = sent
        except RETRY_LATER as exc:
            # Lost after its COMMIT was sent: it may have landed, and storing the batch again
            # would count twice what is not idempotent (a dead letter's seen_count, ...). A
            # rollback PostgreSQL answered (class 40: serialization, deadlock) is certain.
            if (
                sent is None
                or sent.xact is None
                or isinstance(exc, asyncpg.exceptions.TransactionRollbackError)
                or not await self._committed(sent.xact, exc, retry)
            ):
                raise
            result = sent
            if breaker is not None:
                await self._settle(breaker, [*batch.items, *settled], retry)
        finally:
            self.ingest_metrics.transactions.inc()
        self.stored_total += result.stored
        self.mapping_memory.recorded(result.mapped)
        if self.sparkplug is not None and result.sparkplug is not None:
            self.sparkplug.committed(result.sparkplug)  # the births it wrote, held
        # Committed: only now are its alarms and receipts counted (a rolled-back batch, retried
        # or split, counts nothing).
        if self.engine is not None and result.alarms is not None:
            try:
                self.engine.committed(result.alarms)
            except Exception:  # counting must never undo or repeat a committed batch
                log.exception("alarm_counting_failed")
        if self.receipts is not None and result.receipts:
            try:
                self.receipts.committed(result.receipts)
            except Exception:  # as above
                log.exception("receipt_counting_failed")
        return result

    async def _committed(self, xact: Xact, lost: BaseException, retry: Backoff) -> bool:
        """The connection was lost after the COMMIT of transaction ``xact`` was sent
        (``lost``), its answer unheard: whether it committed, asked on another connection
        (while the database is away, until it is back). A transaction the server has not
        finished yet is waited for, up to ``COMMIT_STATUS_WAIT_S``; then (or when PostgreSQL
        no longer knows the id) it counts as not committed, and the batch is stored again as
        before. Only the server that gave the id, not restarted since, can tell: after a
        failover the promoted standby goes on with the same ids, and one it never received
        may have been given to another transaction there, which a "committed" would take for
        this batch's (acknowledged, and lost). Another server's answer is not asked: the
        batch is stored again (its telemetry and alarms are idempotent by event id).
        "committed" comes back only once as durable as a commit (``repo.xact_status``: a
        synchronous standby has it); the question cut short is asked again."""
        xid = xact.id
        log.warning("commit_answer_lost", database=self.database, xid=xid, error=repr(lost))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + COMMIT_STATUS_WAIT_S
        while True:
            try:
                async with self._connection() as conn:
                    same_server, status = await repo.xact_status(conn, xact)
            except RETRY_LATER as exc:
                await self._database_away(exc, retry)
                continue
            except asyncpg.PostgresError as exc:
                # An id this server never gave ("in the future": a standby promoted since):
                # it cannot tell, and the batch is stored again.
                log.warning("commit_status_unknown", xid=xid, error=repr(exc))
                same_server, status = True, None
            if not same_server:
                log.warning("commit_status_other_server", xid=xid)
                status = "other server"
                break
            if status != "in progress":
                break
            delay = retry.next_delay()
            if loop.time() + delay > deadline:
                break
            await asyncio.sleep(delay)
        log.warning("commit_status", xid=xid, status=status)
        self.ingest_metrics.lost_commits.labels((status or "unknown").replace(" ", "_")).inc()
        retry.reset()
        return status == "committed"

    async def _settle(
        self, breaker: CrashLoopBreaker, items: Sequence[Inbound], retry: Backoff
    ) -> None:
        """``breaker.settled`` after a commit heard of on another connection."""
        while True:
            try:
                async with self._connection() as conn:
                    await breaker.settled(conn, items)
            except RETRY_LATER as exc:
                await self._database_away(exc, retry)
            else:
                return

    def _in_flight_items(self, items: list[Inbound]) -> list[Inbound]:
        """What the breaker's journal holds while ``items`` are stored: they alone when
        nothing else is in flight (a suspect alone, so that a death points at it), else every
        message of every flight not landed, in delivery order of their flights."""
        flights = self._flights
        if len(flights) <= 1:
            return items
        return [item for flight in flights for item in flight.items]

    def _count_statement(self, _: object) -> None:
        self.ingest_metrics.statements.inc()

    async def _isolate_refused(
        self, items: list[Inbound], retry: Backoff
    ) -> tuple[list[Inbound], list[DeadLetterRow]]:
        """Try each message alone; the ones the database accepts, and the others' dead letters."""
        kept: list[Inbound] = []
        rejected: list[DeadLetterRow] = []
        for item in items:
            while True:
                try:
                    refusal = await self._probe(item)
                except RETRY_LATER as exc:
                    self.metrics.db_retries.inc()
                    log.warning("database_unavailable", database=self.database, error=repr(exc))
                    await asyncio.sleep(retry.next_delay())
                    continue
                if refusal is None:
                    kept.append(item)
                else:
                    rejected.append(self.decoder.dead_letter(item, *refusal))
                break
        return kept, rejected

    async def _probe(self, item: Inbound) -> tuple[str, str] | None:
        """Store one message the way its batch would, in a transaction always rolled back;
        the refusal (its reason code and detail), if any."""
        alone = self.decoder.classify([item])
        async with self._connection(counted=False) as conn:
            transaction = conn.transaction()
            await transaction.start()
            try:
                await store(
                    conn,
                    alone,
                    self.node_id,
                    self.engine,
                    self.receipts,
                    sparkplug=self.sparkplug,
                )
            except Exception as exc:
                if isinstance(exc, RETRY_LATER):
                    raise
                if refusal_reason(exc) == STORAGE_REJECTED:
                    return STORAGE_REJECTED, str(exc)
                # A bug one message sets off: logged once, with the message's identity.
                log.error(
                    "message_processing_failed",
                    stage="store",
                    topic=item.topic,
                    payload_sha256=item.sha256 or hashlib.sha256(item.payload).hexdigest(),
                    exc_info=exc,
                )
                return PROCESSING_FAILED, failure_detail(exc)
            finally:
                await transaction.rollback()
        return None
