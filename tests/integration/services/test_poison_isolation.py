"""One message's failure costs that message alone: an exception nobody expected in decoding
or in the rules dead-letters it (PROCESSING_FAILED) and its batch goes on; the crash-loop
breaker remembers, in PostgreSQL, what was in flight when a process died. A batch tried
again (split around such a message, or after losing a race) counts what it did once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime

import asyncpg
import msgspec
import pytest

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.commands.lifecycle import mark_sent
from gateway.commands.receipts import ReceiptApplier
from gateway.domain.command import Delivery
from gateway.domain.errors import ConcurrentWriteError
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.ingest.breaker import CrashLoopBreaker, digest
from gateway.ingest.decoder import Classified, Inbound, MessageDecoder
from gateway.ingest.live_path import LivePath
from gateway.ingest.replay import replay_one
from gateway.ingest.store import set_aside_unbounded_telemetry
from gateway.ingest.writer import IngestWriter
from gateway.support.backoff import Backoff
from gateway.support.metrics import Metrics
from protocol import CommandReceipt, Encoding, ReceiptResult, Telemetry, Topics
from protocol.codec import encode_receipt
from storage import commands, ingest
from storage.commands import CommandRow
from storage.ingest import DeadLetterRow
from tests.support.commands import new_command
from tests.support.journal import journal_digests

TOPICS = Topics("iot")
T0 = 1767225600000
RULES = compile_rules([RuleConfig(key="sos", kind="event", event="SOS", severity="CRITICAL")])


class BuggyEngine(AlarmEngine):
    """The real engine, with a bug that one device's messages set off."""

    async def on_stored(
        self,
        conn: asyncpg.Connection,
        messages: Sequence[tuple[str, str, Telemetry]],
        *,
        now: datetime | None = None,
        heard_at: datetime | None = None,
        received: Mapping[str, float] | None = None,
    ) -> BatchAlarms:
        if any(device.startswith("bug") for device, _, _ in messages):
            raise TypeError("can't compare offset-naive and offset-aware datetimes")
        return await super().on_stored(
            conn, messages, now=now, heard_at=heard_at, received=received
        )


class LosesOneRace(AlarmEngine):
    """The real engine, except that its first batch with telemetry loses a conditional write
    to another node (ConcurrentWriteError: the whole batch is tried again), as two nodes
    sharing devices do."""

    lost = False

    async def on_stored(
        self,
        conn: asyncpg.Connection,
        messages: Sequence[tuple[str, str, Telemetry]],
        *,
        now: datetime | None = None,
        heard_at: datetime | None = None,
        received: Mapping[str, float] | None = None,
    ) -> BatchAlarms:
        if messages and not self.lost:
            self.lost = True
            raise ConcurrentWriteError("another node raised this alarm first")
        return await super().on_stored(
            conn, messages, now=now, heard_at=heard_at, received=received
        )


class BrokenEngine(AlarmEngine):
    """Rules that fail on every batch, after its receipts are applied."""

    async def on_stored(
        self,
        conn: asyncpg.Connection,
        messages: Sequence[tuple[str, str, Telemetry]],
        *,
        now: datetime | None = None,
        heard_at: datetime | None = None,
        received: Mapping[str, float] | None = None,
    ) -> BatchAlarms:
        raise TypeError("a bug in the rules")


class BuggyDecoder(MessageDecoder):
    def _classify_one(self, out: Classified, item: Inbound) -> None:
        if "odd" in item.topic:
            raise KeyError("a bug in decoding")
        super()._classify_one(out, item)


def _writer(
    pool: asyncpg.Pool,
    *,
    decoder: MessageDecoder | None = None,
    engine: type[AlarmEngine] = BuggyEngine,
) -> IngestWriter:
    metrics = Metrics()
    return IngestWriter(
        pool=pool,
        decoder=decoder or MessageDecoder(TOPICS, Encoding.JSON, 65536),
        node_id="node-a",
        metrics=metrics,
        batch_size=100,
        linger_s=0.0,
        queue_max=1000,
        retry=Backoff(0.01, 0.1),
        engine=engine(rules=RULES, node_id="node-a", metrics=metrics),
        receipts=ReceiptApplier(node_id="node-a", sent_timeout_s=60, metrics=metrics),
        breaker=CrashLoopBreaker("node-a"),
    )


def _sos(device: str, n: int = 0) -> Inbound:
    payload = msgspec.json.encode({"ts": T0 + n, "events": [{"type": "SOS"}]})
    return Inbound(topic=TOPICS.telemetry(device), payload=payload)


async def _sent_command(conn: asyncpg.Connection) -> CommandRow:
    await new_command(conn, device_id="valve-1", name="open_valve", params={"valve": 2},
                      delivery=Delivery.REALTIME, actor="op", node_id="api")  # fmt: skip
    (row,) = await commands.claim_due(
        conn, node_id="node-a", lease_s=30, limit=10, max_in_flight=1, actor="system:dispatcher"
    )
    sent = await mark_sent(conn, row, node_id="node-a", sent_timeout_s=60)
    assert sent is not None
    return sent


def _acked(command: CommandRow) -> Inbound:
    receipt = CommandReceipt(
        command_id=command.id, claim_generation=command.claim_generation, node_id="node-a",
        result=ReceiptResult.ACKED, result_code=0,
    )  # fmt: skip
    return Inbound(topic=TOPICS.acks(command.device_id), payload=encode_receipt(receipt))


async def _counted_as_audited(
    metrics: Metrics, conn: asyncpg.Connection, command: CommandRow
) -> None:
    """The command ACKED by one receipt: one receipt row, one SENT -> ACKED audit row, and
    each counted once (the receipt, the transition, its latency)."""
    assert await conn.fetchval("SELECT status FROM command WHERE id = $1", command.id) == "ACKED"
    audited = await conn.fetchval(
        "SELECT count(*) FROM command_audit WHERE command_id = $1 AND from_status = 'SENT' "
        "AND to_status = 'ACKED'",
        command.id,
    )
    logged = await conn.fetch(
        "SELECT outcome FROM command_receipt WHERE command_id = $1", command.id
    )
    assert (audited, [r["outcome"] for r in logged]) == (1, ["accepted"])
    sample = metrics.registry.get_sample_value
    counted = (
        sample("gateway_command_receipts_total", {"outcome": "accepted", "reason": ""}),
        sample("gateway_command_transitions_total", {"from_status": "SENT", "to_status": "ACKED"}),
        sample("gateway_command_dispatch_to_receipt_seconds_count"),
    )
    assert counted == (1, 1, 1)


async def _handle(writer: IngestWriter, items: list[Inbound]) -> None:
    """Through the writer's own loop, one batch, until stored and acknowledged."""
    task = asyncio.create_task(writer.run())
    try:
        await writer.put_many(items)
        assert await writer.drain(30)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.fixture
async def conn(db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(db_dsn)
    try:
        yield c
    finally:
        await c.close()


async def test_an_exception_in_the_rules_dead_letters_that_message_alone(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    writer = _writer(pool)
    await writer.recover()
    batch = [_sos("good-1"), _sos("bug-1"), _sos("good-2")]
    await _handle(writer, batch)
    stored = await conn.fetch("SELECT device_id FROM telemetry ORDER BY device_id")
    assert [r["device_id"] for r in stored] == ["good-1", "good-2"]
    alarms = await conn.fetch("SELECT device_id FROM alarm ORDER BY device_id")
    assert [r["device_id"] for r in alarms] == ["good-1", "good-2"]
    letter = await conn.fetchrow("SELECT topic, payload, reason, detail FROM dead_letter")
    assert (letter["topic"], bytes(letter["payload"]), letter["reason"]) == (
        batch[1].topic,
        batch[1].payload,
        "PROCESSING_FAILED",
    )
    assert letter["detail"] == (
        "processing raised TypeError: can't compare offset-naive and offset-aware datetimes"
    )
    counted = writer.metrics.registry.get_sample_value(
        "gateway_dead_letters_total", {"reason": "PROCESSING_FAILED"}
    )
    assert counted == 1


async def test_an_exception_in_decoding_dead_letters_that_message_alone(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    writer = _writer(pool, decoder=BuggyDecoder(TOPICS, Encoding.JSON, 65536))
    await _handle(writer, [_sos("good-1"), _sos("odd-1"), _sos("good-2")])
    assert await conn.fetchval("SELECT count(*) FROM telemetry") == 2
    letter = await conn.fetchrow("SELECT topic, reason, detail FROM dead_letter")
    assert (letter["topic"], letter["reason"]) == (TOPICS.telemetry("odd-1"), "PROCESSING_FAILED")
    assert letter["detail"] == "processing raised KeyError: 'a bug in decoding'"


async def test_replaying_a_message_the_rules_still_fail_on_says_so(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    writer = _writer(pool)
    await _handle(writer, [_sos("bug-1")])
    letter_id = await conn.fetchval("SELECT id FROM dead_letter")
    assert writer.engine is not None
    assert writer.receipts is not None
    path = LivePath(writer.decoder, "node-a", writer.engine, writer.receipts)
    outcome = await replay_one(pool, path, letter_id)
    assert outcome is not None
    assert (outcome.outcome, outcome.succeeded) == ("still_invalid: PROCESSING_FAILED", False)
    assert await conn.fetchval("SELECT count(*) FROM telemetry") == 0


async def test_a_receipt_in_a_batch_split_around_a_poisoned_message_is_counted_once(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """The whole batch fails on the poisoned message and is rolled back, each message is tried
    alone (rolled back too), and the rest is stored: the receipt is counted by that commit
    alone, as it is audited."""
    command = await _sent_command(conn)
    writer = _writer(pool)
    await _handle(writer, [_acked(command), _sos("bug-1")])
    assert await conn.fetchval("SELECT count(*) FROM dead_letter") == 1
    await _counted_as_audited(writer.metrics, conn, command)


async def test_a_receipt_in_a_batch_retried_after_losing_a_race_is_counted_once(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """Another node wrote an alarm of the batch first: the whole batch is rolled back and tried
    again, and its receipt counted by the commit alone."""
    command = await _sent_command(conn)
    writer = _writer(pool, engine=LosesOneRace)
    await _handle(writer, [_acked(command), _sos("door-1")])
    assert isinstance(writer.engine, LosesOneRace)
    assert writer.engine.lost
    await _counted_as_audited(writer.metrics, conn, command)


async def test_a_replayed_receipt_is_counted_only_by_the_replay_that_commits(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    command = await _sent_command(conn)
    acked = _acked(command)
    await ingest.insert_dead_letters(
        conn, [DeadLetterRow.whole(acked.topic, acked.payload, "INVALID", "once refused")], "n"
    )
    letter_id = await conn.fetchval("SELECT id FROM dead_letter")
    metrics = Metrics()
    decoder = MessageDecoder(TOPICS, Encoding.JSON, 65536)
    receipts = ReceiptApplier(node_id="node-a", sent_timeout_s=60, metrics=metrics)
    broken = BrokenEngine(rules=RULES, node_id="node-a", metrics=metrics)
    failed = await replay_one(pool, LivePath(decoder, "node-a", broken, receipts), letter_id)
    assert failed is not None
    assert failed.outcome == "still_invalid: PROCESSING_FAILED"
    assert await conn.fetchval("SELECT status FROM command WHERE id = $1", command.id) == "SENT"
    fine = AlarmEngine(rules=RULES, node_id="node-a", metrics=metrics)
    done = await replay_one(pool, LivePath(decoder, "node-a", fine, receipts), letter_id)
    assert done is not None
    assert done.outcome == "receipt"
    await _counted_as_audited(metrics, conn, command)


async def _journal(conn: asyncpg.Connection) -> list[bytes]:
    return await journal_digests(conn, "node-a")


async def test_deaths_in_a_row_are_counted_suspects_judged_alone_and_the_second_quarantined(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    batch = [_sos("a"), _sos("killer"), _sos("b")]
    # Run one stores nothing: it "dies" after writing its journal (as a process killed
    # mid-batch would leave it).
    first = CrashLoopBreaker("node-a")
    await first.recover(conn)
    await first.journal(conn, batch)

    # Run two: each of the three counts one death; judged alone, a and b are stored and
    # forgotten; the killer "kills" this run too, alone in the journal.
    writer = _writer(pool)
    await writer.recover()
    assert writer.breaker is not None
    assert sorted(writer.breaker.suspects.values()) == [1, 1, 1]
    quarantined, groups = writer.breaker.split(batch)
    assert quarantined == []
    assert [[i.topic for i in g] for g in groups] == [[i.topic] for i in batch]
    await _handle(writer, [batch[0]])
    await writer.breaker.journal(conn, [batch[1]])
    # The journal now holds the killer alone.
    assert await _journal(conn) == [digest(batch[1])]

    # Run three: the killer is at two deaths and set aside unprocessed; b (one death) is
    # stored; nothing stays suspected.
    third = _writer(pool)
    await third.recover()
    assert third.breaker is not None
    assert sorted(third.breaker.suspects.values()) == [1, 2]
    await _handle(third, [batch[1], batch[2]])
    assert await conn.fetchval("SELECT count(*) FROM telemetry") == 2
    letter = await conn.fetchrow("SELECT topic, payload, reason, detail FROM dead_letter")
    assert (letter["topic"], bytes(letter["payload"]), letter["reason"]) == (
        batch[1].topic,
        batch[1].payload,
        "QUARANTINED",
    )
    # The quarantined message stays remembered; the one stored is forgotten.
    assert await conn.fetchval("SELECT count(*) FROM ingest_suspect") == 1
    assert third.breaker.suspects == {digest(batch[1]): 2}
    # The same bytes again later (retained, repeated) are quarantined again, never processed
    # a third time: the same letter counts the arrival. (Until 2026-12-06 the quarantine was
    # spent: a retained killer killed every start after its quarantine.)
    await _handle(third, [batch[1]])
    assert await conn.fetchval("SELECT count(*) FROM telemetry") == 2
    assert await conn.fetchval("SELECT seen_count FROM dead_letter") == 2

    # A clean stop leaves nothing in flight: the next start counts no death.
    await third.stopped_cleanly()
    fourth = _writer(pool)
    await fourth.recover()
    assert fourth.breaker is not None
    assert fourth.breaker.suspects == {digest(batch[1]): 2}


async def test_a_death_counts_only_in_a_row(pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
    message = _sos("flaky")
    dying = CrashLoopBreaker("node-a")
    await dying.recover(conn)
    await dying.journal(conn, [message])
    # The next run stores it: its one death is forgotten.
    writer = _writer(pool)
    await writer.recover()
    await _handle(writer, [message])
    assert await conn.fetchval("SELECT count(*) FROM ingest_suspect") == 0
    # A later death with it in flight is its first in a row again: judged, not quarantined.
    assert writer.breaker is not None
    await writer.breaker.journal(conn, [message])
    again = _writer(pool)
    await again.recover()
    assert again.breaker is not None
    assert list(again.breaker.suspects.values()) == [1]
    assert again.breaker.split([message]) == ([], [[message]])


async def test_telemetry_stored_at_infinity_before_the_fix_becomes_a_dead_letter(
    conn: asyncpg.Connection,
) -> None:
    await conn.execute(
        """
        INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, events, node_id)
        VALUES (repeat('1', 64), 'clock-9999', 'infinity', 7, '{"temp": 60}', NULL, 'x'),
               (repeat('2', 64), 'clock-0001', '-infinity', NULL, NULL, '[{"type": "SOS"}]', 'x'),
               (repeat('3', 64), 'fine', '2026-01-01T00:00:00Z', NULL, '{"temp": 1}', NULL, 'x')
        """
    )
    assert await set_aside_unbounded_telemetry(conn, TOPICS, "node-a") == 2
    assert await conn.fetchval("SELECT array_agg(event_id) FROM telemetry") == ["3" * 64]
    letters = await conn.fetch("SELECT topic, payload, reason FROM dead_letter ORDER BY topic")
    assert [(r["topic"], msgspec.json.decode(r["payload"]), r["reason"]) for r in letters] == [
        (
            TOPICS.telemetry("clock-0001"),
            {"ts": "0001-01-01T00:00:00Z", "events": [{"type": "SOS"}]},
            "INVALID",
        ),
        (
            TOPICS.telemetry("clock-9999"),
            {"ts": "9999-12-31T23:59:59.999999Z", "seq": 7, "metrics": {"temp": 60}},
            "INVALID",
        ),
    ]
    assert await set_aside_unbounded_telemetry(conn, TOPICS, "node-a") == 0
