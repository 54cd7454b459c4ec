"""Everything a batch writes, in the caller's transaction: telemetry, devices, presence, dead
letters, command receipts, and the rule state and alarms the new telemetry moves."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg
import msgspec
import structlog

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.commands.receipts import ReceiptApplier
from gateway.ingest.decoder import Classified
from protocol import Topics
from storage import breaker as breaker_repo
from storage import ingest as repo
from storage.ingest import DeadLetterRow

log = structlog.get_logger(__name__)


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
    await repo.record_device_mappings(conn, batch.mapped_devices)
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


async def set_aside_unbounded_telemetry(
    conn: asyncpg.Connection, topics: Topics, node_id: str
) -> int:
    """Telemetry stored at PostgreSQL's ±infinity before such times were refused at decoding
    (a sample dated 9999-12-31T23:59:59.999999Z or 0001-01-01T00:00:00Z) becomes a dead
    letter, INVALID, whose payload is the message as it was stored: nothing is lost, and no
    reader meets a time it cannot hold. At start; a no-op once done (such rows can only be
    in the default partition, which is small)."""
    async with conn.transaction():
        rows = await breaker_repo.take_unbounded_telemetry(conn)
        letters = []
        for row in rows:
            message: dict[str, object] = {
                "ts": "9999-12-31T23:59:59.999999Z" if row.future else "0001-01-01T00:00:00Z"
            }
            if row.seq is not None:
                message["seq"] = row.seq
            if row.metrics_json is not None:
                message["metrics"] = msgspec.Raw(row.metrics_json.encode())
            if row.events_json is not None:
                message["events"] = msgspec.Raw(row.events_json.encode())
            letters.append(
                DeadLetterRow.whole(
                    topics.telemetry(row.device_id),
                    msgspec.json.encode(message),
                    "INVALID",
                    f"stored as event {row.event_id} with a time PostgreSQL holds as "
                    f"{'infinity' if row.future else '-infinity'}, before such times were "
                    "refused; set aside at start",
                )
            )
        await repo.insert_dead_letters(conn, letters, node_id)
    if letters:
        log.warning("unbounded_telemetry_set_aside", rows=len(letters))
    return len(letters)
