"""The ingest pipeline: reader → bounded queue → batch → one transaction → acknowledgements.

A message is acknowledged to the broker only after the transaction that stored it (or its
dead letter) committed. Until then it counts against the broker's window of unacked
messages, which is what bounds memory: when the database is slow or down, the queue fills,
the reader blocks, the window fills and the broker stops sending.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import asyncpg
import msgspec
import structlog

from gateway.alarm_engine import AlarmEngine, BatchAlarms
from gateway.alarms import RetryBatchError
from gateway.backoff import Backoff
from gateway.commands import apply_receipt
from gateway.metrics import Metrics, observe_many
from protocol import (
    CommandReceipt,
    DecodeError,
    Encoding,
    Telemetry,
    TopicError,
    TopicKind,
    Topics,
    decode_presence,
    decode_receipt,
    decode_telemetry,
    telemetry_event_id,
)
from storage import ingest as repo
from storage.errors import TRANSIENT_DB_ERRORS
from storage.ingest import DeadLetterRow, TelemetryRow

log = structlog.get_logger("gateway.ingest")

# Reason codes of dead letters, beyond the decoder's OVERSIZED / MALFORMED / INVALID and the
# topic parser's BAD_TOPIC / BAD_DEVICE_ID.
STORAGE_REJECTED = "STORAGE_REJECTED"
# Bytes of a payload a dead letter keeps by default ([ingest] dead_letter_max_bytes).
DEAD_LETTER_MAX_BYTES = 65536

# Errors after which the same transaction may succeed later: the database is away (see
# storage.errors), or another node raised the same alarm first. Anything else is about the data.
RETRY_LATER: tuple[type[BaseException], ...] = (*TRANSIENT_DB_ERRORS, RetryBatchError)


# The driver refusing a value before it reaches the server (out of a column type's range, say):
# about the data, never transient, though asyncpg derives it from InterfaceError.
REFUSED_DATA: tuple[type[BaseException], ...] = (asyncpg.exceptions.DataError,)


class Acker(Protocol):
    def ack(self, message: Any, /) -> bool: ...


@dataclass(slots=True)
class Inbound:
    """One message from the broker (or a dead letter being replayed, with no acker)."""

    topic: str
    payload: bytes
    received_at: float = 0.0
    acker: Acker | None = None
    message: object = None
    # Set when only the first bytes of a payload no message may have were kept (see
    # MessageDecoder.admit): the size and SHA-256 (hex) of the whole payload as it arrived.
    size: int | None = None
    sha256: str | None = None


@dataclass(slots=True)
class Classified:
    """A batch sorted into what each message becomes."""

    # The messages sorted, in order (a batch refused by the database is split by them).
    items: list[Inbound] = field(default_factory=list)
    telemetry: list[TelemetryRow] = field(default_factory=list)
    telemetry_sources: list[Inbound] = field(default_factory=list)
    decoded: list[Telemetry] = field(default_factory=list)
    presence: dict[str, str] = field(default_factory=dict)
    receipts: list[tuple[str, CommandReceipt]] = field(default_factory=list)
    dead_letters: list[DeadLetterRow] = field(default_factory=list)
    seen_devices: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class StoreResult:
    new_event_ids: frozenset[str]
    telemetry: int
    presence: int
    dead_letters: tuple[DeadLetterRow, ...]
    alarms: BatchAlarms | None = None

    @property
    def stored(self) -> int:
        return len(self.new_event_ids)

    @property
    def duplicates(self) -> int:
        return self.telemetry - len(self.new_event_ids)


class ReceiptApplier:
    """Applies command receipts in the ingest transaction (so the PUBACK follows the commit)."""

    def __init__(self, *, node_id: str, sent_timeout_s: float, metrics: Metrics | None) -> None:
        self.node_id = node_id
        self.sent_timeout_s = sent_timeout_s
        self.metrics = metrics

    async def apply(
        self, conn: asyncpg.Connection, receipts: Sequence[tuple[str, CommandReceipt]]
    ) -> None:
        for device_id, receipt in receipts:
            applied = await apply_receipt(
                conn, device_id=device_id, receipt=receipt, node_id=self.node_id,
                sent_timeout_s=self.sent_timeout_s,
            )  # fmt: skip
            if self.metrics is not None:
                reason = "" if applied.reason is None else applied.reason.value
                self.metrics.command_receipts.labels(applied.outcome.value, reason).inc()
                row, before = applied.command, applied.previous_status
                if row is not None and before is not None and row["status"] != before:
                    self.metrics.count_command(before, row["status"])
                    if row["finished_at"] is not None and row["claimed_at"] is not None:
                        latency = (row["finished_at"] - row["claimed_at"]).total_seconds()
                        self.metrics.command_latency.observe(max(latency, 0.0))


class MessageDecoder:
    """Turns (topic, payload) into a telemetry row, a presence update or a dead letter."""

    def __init__(
        self,
        topics: Topics,
        encoding: Encoding,
        max_payload_bytes: int,
        dead_letter_max_bytes: int = DEAD_LETTER_MAX_BYTES,
    ) -> None:
        self.topics = topics
        self.encoding = encoding
        self.max_payload_bytes = max_payload_bytes
        self.dead_letter_max_bytes = dead_letter_max_bytes

    def admit(self, payload: bytes) -> tuple[bytes, int | None, str | None]:
        """``(payload, None, None)``, or for a payload that can only become a dead letter
        (longer than any message may be) and longer than a dead letter keeps: its first bytes,
        its size and its SHA-256. The rest need not stay in memory while it waits."""
        if len(payload) <= self.max_payload_bytes or len(payload) <= self.dead_letter_max_bytes:
            return payload, None, None
        digest = hashlib.sha256(payload).hexdigest()
        return payload[: self.dead_letter_max_bytes], len(payload), digest

    def dead_letter(self, item: Inbound, reason: str, detail: str) -> DeadLetterRow:
        """The dead letter of ``item``: at most ``dead_letter_max_bytes`` of its payload, with
        the size and SHA-256 of all of it."""
        if item.size is not None and item.sha256 is not None:  # cut down on arrival
            return DeadLetterRow(item.topic, item.payload, reason, detail, item.size, item.sha256)
        payload = item.payload
        return DeadLetterRow(
            item.topic, payload[: self.dead_letter_max_bytes], reason, detail, len(payload),
            hashlib.sha256(payload).hexdigest(),
        )  # fmt: skip

    def classify(self, items: Sequence[Inbound]) -> Classified:
        out = Classified(items=list(items))
        for item in items:
            try:
                target = self.topics.parse_device_topic(item.topic)
            except TopicError as exc:
                out.dead_letters.append(self.dead_letter(item, exc.code, str(exc)))
                continue
            device_id = target.device_id
            if item.size is not None:
                if target.kind is TopicKind.TELEMETRY:
                    out.seen_devices.add(device_id)  # as for any other oversized telemetry
                detail = f"payload is {item.size} bytes, the limit is {self.max_payload_bytes}"
                out.dead_letters.append(self.dead_letter(item, "OVERSIZED", detail))
                continue
            try:
                if target.kind is TopicKind.TELEMETRY:
                    out.seen_devices.add(device_id)
                    message = decode_telemetry(
                        item.payload, self.encoding, max_bytes=self.max_payload_bytes
                    )
                    out.telemetry.append(_row(device_id, message))
                    out.telemetry_sources.append(item)
                    out.decoded.append(message)
                elif target.kind is TopicKind.STATUS:
                    out.presence[device_id] = decode_presence(item.payload).value
                elif target.kind is TopicKind.ACKS:
                    receipt = decode_receipt(
                        item.payload, self.encoding, max_bytes=self.max_payload_bytes
                    )
                    out.receipts.append((device_id, receipt))
                else:
                    out.dead_letters.append(
                        self.dead_letter(
                            item,
                            "UNSUPPORTED_TOPIC",
                            f"the gateway does not consume {target.kind.value} messages",
                        )
                    )
            except DecodeError as exc:
                out.dead_letters.append(self.dead_letter(item, exc.code, exc.detail))
        return out


def _row(device_id: str, message: Telemetry) -> TelemetryRow:
    return TelemetryRow(
        event_id=telemetry_event_id(device_id, message),
        device_id=device_id,
        ts=message.timestamp(),
        seq=message.seq,
        metrics_json=None
        if message.metrics is None
        else msgspec.json.encode(message.metrics).decode(),
        events_json=None
        if message.events is None
        else msgspec.json.encode(message.events).decode(),
    )


async def store(
    conn: asyncpg.Connection,
    batch: Classified,
    node_id: str,
    engine: AlarmEngine | None = None,
    receipts: ReceiptApplier | None = None,
) -> StoreResult:
    """Everything a batch writes, in the caller's transaction: telemetry, devices, presence,
    dead letters, command receipts, and the alarms the new telemetry raises or clears."""
    new_ids = await repo.insert_telemetry(conn, batch.telemetry, node_id)
    await repo.touch_devices(conn, batch.seen_devices)
    await repo.record_presence(conn, batch.presence)
    await repo.insert_dead_letters(conn, batch.dead_letters, node_id)
    if batch.receipts:
        if receipts is None:
            raise RuntimeError("command receipts in a batch but no receipt applier configured")
        await receipts.apply(conn, batch.receipts)
    alarms = None
    if engine is not None:
        fresh = []
        evaluated: set[str] = set()
        for row, message in zip(batch.telemetry, batch.decoded, strict=True):
            # Only what was new, once: a redelivery must not raise anything again.
            if row.event_id in new_ids and row.event_id not in evaluated:
                evaluated.add(row.event_id)
                fresh.append((row.device_id, row.event_id, message))
        alarms = await engine.on_stored(conn, fresh)
    return StoreResult(
        new_event_ids=frozenset(new_ids),
        telemetry=len(batch.telemetry),
        presence=len(batch.presence),
        dead_letters=tuple(batch.dead_letters),
        alarms=alarms,
    )


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
    ) -> None:
        self.pool = pool
        self.receipts = receipts
        # Probes apply receipts in transactions that are rolled back: nothing to count.
        self.probe_receipts = (
            None
            if receipts is None
            else ReceiptApplier(
                node_id=receipts.node_id, sent_timeout_s=receipts.sent_timeout_s, metrics=None
            )
        )
        self.refused_batch_attempts = refused_batch_attempts
        self.decoder = decoder
        self.node_id = node_id
        self.metrics = metrics
        self.batch_size = batch_size
        self.linger_s = linger_s
        self.retry = retry
        self.engine = engine
        self.queue: asyncio.Queue[Inbound] = asyncio.Queue(maxsize=queue_max)
        self.last_progress = 0.0
        # Set while a database call of the writer is under way: a call that never returns
        # (a lock, a black-holed connection) is what "stuck" means to the watchdog. Failing
        # fast and retrying is not stuck.
        self.in_db_call_since: float | None = None
        self.stored_total = 0

    async def put(self, item: Inbound) -> None:
        """Blocks while the queue is full: overload slows the reader, never grows memory."""
        self.metrics.inflight.inc()
        await self.queue.put(item)

    async def put_many(self, items: Sequence[Inbound]) -> None:
        """``put`` for each, in order, waiting only when the queue is full."""
        queue = self.queue
        self.metrics.inflight.inc(len(items))
        for item in items:
            if queue.full():
                await queue.put(item)
            else:
                queue.put_nowait(item)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every queued message is stored and acknowledged (False on timeout)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.queue.join()
        except TimeoutError:
            return False
        return True

    async def run(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                await self._handle(batch)
            finally:
                for _ in batch:
                    self.queue.task_done()
                self.metrics.inflight.dec(len(batch))

    async def _next_batch(self) -> list[Inbound]:
        queue = self.queue
        batch = [await queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.linger_s
        while len(batch) < self.batch_size:
            while len(batch) < self.batch_size and not queue.empty():
                batch.append(queue.get_nowait())
            remaining = deadline - loop.time()
            if len(batch) >= self.batch_size or remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    batch.append(await queue.get())
            except TimeoutError:
                break
        return batch

    async def _handle(self, batch: list[Inbound]) -> None:
        classified = self.decoder.classify(batch)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await self.store_with_retry(classified)
        done = loop.time()
        self.metrics.commit_seconds.observe(done - started)
        self.metrics.batch_size.observe(len(batch))
        skipped = 0
        latencies: dict[float, int] = {}  # a reader's chunk shares one arrival time
        for item in batch:
            if item.acker is not None:
                if not item.acker.ack(item.message):
                    skipped += 1
                latencies[item.received_at] = latencies.get(item.received_at, 0) + 1
        if skipped:
            self.metrics.acks_skipped.inc(skipped)
        for received_at, count in latencies.items():
            observe_many(self.metrics.handler_seconds, done - received_at, count)
        self._count(result, received=len(classified.telemetry_sources))
        self.last_progress = done

    def _count(self, result: StoreResult, *, received: int) -> None:
        m = self.metrics
        m.telemetry_received.inc(received)
        m.telemetry_stored.inc(result.stored)
        m.telemetry_duplicates.inc(result.duplicates)
        m.presence_updates.inc(result.presence)
        for letter in result.dead_letters:
            m.dead_letters.labels(letter.reason).inc()
            log.warning(
                "message_dead_lettered",
                topic=letter.topic,
                reason=letter.reason,
                detail=letter.detail,
                payload_bytes=letter.payload_size,
                payload_sha256=letter.payload_sha256,
                truncated=letter.truncated,
            )

    async def store_with_retry(self, batch: Classified) -> StoreResult:
        """Commit the batch, retrying for as long as the database is unreachable.

        A batch the database refuses for its content (say, a string PostgreSQL cannot hold)
        would otherwise be retried forever: each of its messages is tried alone, and those
        refused on their own become dead letters, so one bad message never blocks the ones
        behind it, and the others — command receipts and presence included — are stored as
        usual. A refusal no single message explains (it needs several of them, or comes from
        the database itself) is retried with backoff ``refused_batch_attempts`` times; then
        every message of the batch is dead-lettered rather than blocking the pipeline.
        """
        refused: list[DeadLetterRow] = []  # messages dead-lettered on the way
        unexplained = 0
        while True:
            try:
                result = await self._store_once(batch)
            except RETRY_LATER as exc:
                delay = self.retry.next_delay()
                self.metrics.db_retries.inc()
                log.warning("database_unavailable", error=repr(exc), retry_in_s=round(delay, 3))
                await asyncio.sleep(delay)
                continue
            except (asyncpg.PostgresError, *REFUSED_DATA) as exc:
                log.error("batch_refused_by_database", error=repr(exc), size=len(batch.items))
                kept, rejected = await self._isolate_refused(batch.items)
                if rejected:
                    self.metrics.batch_refusals.labels("true").inc()
                    refused.extend(rejected)
                    batch = self._rebuild(kept, refused)
                    continue
                unexplained += 1
                self.metrics.batch_refusals.labels("false").inc()
                if unexplained >= self.refused_batch_attempts and batch.items:
                    detail = (
                        f"the batch was refused {unexplained} times though no message of it "
                        f"is refused on its own: {exc}"
                    )
                    log.error(
                        "batch_dead_lettered", attempts=unexplained, error=repr(exc),
                        size=len(batch.items),
                    )  # fmt: skip
                    refused.extend(self._dead_letter_all(batch.items, detail))
                    batch = self._rebuild([], refused)
                    continue
                # Nothing left to split: only the dead letters themselves are refused, and
                # retrying (with backoff) is all there is.
                delay = self.retry.next_delay()
                log.warning(
                    "batch_refusal_unexplained", attempt=unexplained, error=repr(exc),
                    retry_in_s=round(delay, 3),
                )  # fmt: skip
                await asyncio.sleep(delay)
                continue
            self.retry.reset()
            return result

    def _rebuild(self, items: list[Inbound], refused: list[DeadLetterRow]) -> Classified:
        batch = self.decoder.classify(items)
        batch.dead_letters.extend(refused)
        return batch

    def _dead_letter_all(self, items: list[Inbound], detail: str) -> list[DeadLetterRow]:
        """Every message as a dead letter: what the decoder said of it, or the refusal."""
        letters: list[DeadLetterRow] = []
        for item in items:
            verdict = self.decoder.classify([item]).dead_letters
            letters.extend(verdict or [self.decoder.dead_letter(item, STORAGE_REJECTED, detail)])
        return letters

    async def _store_once(self, batch: Classified) -> StoreResult:
        self.in_db_call_since = asyncio.get_running_loop().time()
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                result = await store(conn, batch, self.node_id, self.engine, self.receipts)
        finally:
            self.in_db_call_since = None
        self.stored_total += result.stored
        # Committed: only now are its alarms counted (a rolled-back batch counts nothing).
        if self.engine is not None and result.alarms is not None:
            self.engine.committed(result.alarms)
        return result

    async def _isolate_refused(
        self, items: list[Inbound]
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
                    log.warning("database_unavailable", error=repr(exc))
                    await asyncio.sleep(self.retry.next_delay())
                    continue
                if refusal is None:
                    kept.append(item)
                else:
                    rejected.append(self.decoder.dead_letter(item, STORAGE_REJECTED, refusal))
                break
        return kept, rejected

    async def _probe(self, item: Inbound) -> str | None:
        """Store one message the way its batch would, in a transaction always rolled back;
        the refusal, if any."""
        alone = self.decoder.classify([item])
        self.in_db_call_since = asyncio.get_running_loop().time()
        try:
            async with self.pool.acquire() as conn:
                transaction = conn.transaction()
                await transaction.start()
                try:
                    await store(conn, alone, self.node_id, self.engine, self.probe_receipts)
                except (asyncpg.PostgresError, *REFUSED_DATA) as exc:
                    if isinstance(exc, RETRY_LATER):
                        raise
                    return str(exc)
                finally:
                    await transaction.rollback()
        finally:
            self.in_db_call_since = None
        return None
