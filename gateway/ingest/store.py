"""Everything a batch writes, in the caller's transaction: telemetry, devices, presence, dead
letters, command receipts, and the rule state and alarms the new telemetry moves."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg
import msgspec
import structlog

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.commands import sparkplug as sparkplug_writes
from gateway.commands.receipts import AppliedReceipt, ReceiptApplier
from gateway.domain.mappings import RETRANSMISSION_WINDOW_S
from gateway.ingest.decoder import Classified
from gateway.ingest.mapping_memory import MappingMemory, Recorded
from gateway.sparkplug.host import HostOutcome, SparkplugHost
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
    sparkplug: HostOutcome | None = None
    # The mapped devices whose mapping the batch recorded (for the writer's MappingMemory).
    mapped: dict[str, Recorded] = field(default_factory=dict)
    # What its command receipts did, counted once the transaction commits (ReceiptApplier).
    receipts: tuple[AppliedReceipt, ...] = ()
    # The transaction (None: it wrote nothing): whether it committed can be asked on another
    # connection should the answer to its COMMIT be lost (the writer), of the same server.
    xact: repo.Xact | None = None

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
    *,
    sparkplug: SparkplugHost | None = None,
    mappings: MappingMemory | None = None,
    received_at: datetime | None = None,
    write_letters: bool = True,
) -> StoreResult:
    """Everything a batch writes, in the caller's transaction: telemetry, devices, presence,
    dead letters, command receipts, and the alarms the new telemetry raises or clears; the
    Sparkplug messages first, judged against their edge nodes' state (gateway.sparkplug),
    which adds telemetry, presence and dead letters of their own. ``mappings``: what the
    caller's node recorded of its mapped devices (only what is due is recorded; None: all).
    Nothing is counted here: the caller counts the result's alarms and receipts once the
    transaction has committed (a rolled-back attempt counts nothing). ``received_at``: when
    the batch was received if not now (a replayed dead letter): its devices count as heard,
    and its presence as observed, then, never later. ``write_letters``: False for a replayed
    dead letter, which is no new sighting: what is refused again is only reported (the
    result's ``dead_letters``), never written (it would count the pending letter again, or
    write a new one of a letter replayed before)."""
    telemetry, decoded = batch.telemetry, batch.decoded
    # The mapping records first (their locks before the device rows' insert_telemetry takes,
    # in every batch: one order between nodes), with the radio frames when the batch holds
    # any, in one statement: a frame read again (a LoRaWAN retransmission: docs/devices.md)
    # is no reading of its own: counted as a redelivery, neither stored nor judged.
    mapped = batch.mapped_devices if mappings is None else mappings.due(batch.mapped_devices)
    positions = sorted(batch.frames)
    again: set[int] = set()
    if positions:
        again, mapped = await repo.record_mapped_frames(
            conn,
            [batch.frames[p] for p in positions],
            RETRANSMISSION_WINDOW_S,
            mapped,
            batch.mapped_devices,
        )
    else:
        await repo.record_device_mappings(conn, mapped)
    if again:
        dropped = {positions[n] for n in again}
        telemetry = [row for n, row in enumerate(telemetry) if n not in dropped]
        decoded = [message for n, message in enumerate(decoded) if n not in dropped]
    seen, presence, letters = batch.seen_devices, batch.presence, batch.dead_letters
    presence_received = batch.presence_received
    outcome = None
    if batch.sparkplug:
        if sparkplug is None:
            raise RuntimeError("Sparkplug messages in a batch but no Sparkplug host configured")
        # The batch itself is left as it is: a retry of this transaction starts over.
        outcome = await sparkplug.apply(conn, batch.sparkplug)
        telemetry = [*telemetry, *outcome.telemetry]
        decoded = [*decoded, *outcome.decoded]
        seen = seen | outcome.seen_devices
        presence = {**presence, **outcome.presence}
        # A birth or death is ordered by the edge node's state, not by its receipt.
        presence_received = {
            d: t for d, t in presence_received.items() if d not in outcome.presence
        }
        letters = [*letters, *outcome.dead_letters]
    new_ids, db_now, xact = await repo.insert_telemetry_at(
        conn, telemetry, node_id, seen, received_at
    )
    presence_xact = await repo.record_presence(
        conn, presence, received_at, received=presence_received, node_id=node_id
    )
    xact = presence_xact if xact is None else xact
    letters_xact = await repo.insert_dead_letters(conn, letters if write_letters else [], node_id)
    xact = letters_xact if xact is None else xact
    applied = batch.receipts
    if outcome is not None and outcome.telemetry and receipts is not None:
        # Sparkplug has no receipt: a write is confirmed by the value reported back.
        samples = list(zip(outcome.telemetry, outcome.decoded, strict=True))
        applied = [
            *applied,
            *await sparkplug_writes.confirmations(conn, samples, received_at),
        ]
    done: tuple[AppliedReceipt, ...] = ()
    if applied:
        if receipts is None:
            raise RuntimeError("command receipts in a batch but no receipt applier configured")
        done = await receipts.apply(conn, applied)
    alarms = None
    if engine is not None:
        fresh = []
        # An untrusted Sparkplug edge node's data is stored, not judged (docs/sparkplug.md).
        evaluated: set[str] = set() if outcome is None else set(outcome.untrusted)
        for row, message in zip(telemetry, decoded, strict=True):
            # Only what was new, once: a redelivery must not raise anything again.
            if row.event_id in new_ids and row.event_id not in evaluated:
                evaluated.add(row.event_id)
                fresh.append((row.device_id, row.event_id, message))
        alarms = await engine.on_stored(
            conn,
            fresh,
            now=db_now,
            heard_at=received_at,
            received=_read(batch, new_ids) if engine.clears_inactivity else None,
        )
    if xact is None:
        # No statement that tells it was sent (no telemetry, device, presence or dead letter:
        # command receipts only, say): asked apart, and only if the batch wrote something.
        xact = await repo.assigned_xact_id(conn)
    return StoreResult(
        new_event_ids=frozenset(new_ids),
        telemetry=len(telemetry) + len(again),
        presence=len(presence),
        dead_letters=tuple(letters),
        alarms=alarms,
        sparkplug=outcome,
        mapped=mapped,
        receipts=done,
        xact=xact,
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


def _read(batch: Classified, new_ids: Collection[str]) -> dict[str, float]:
    """When the node read each device's newest new message of the batch off the broker, on
    the loop's clock (``Inbound.received_at``); a device missing has none known (a replayed
    dead letter, Sparkplug)."""
    read: dict[str, float] = {}
    for row, source in zip(batch.telemetry, batch.telemetry_sources, strict=True):
        at = source.received_at
        if at > 0 and row.event_id in new_ids and at > read.get(row.device_id, 0.0):
            read[row.device_id] = at
    return read
