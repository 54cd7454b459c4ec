"""Two transactions in flight (``[ingest] transactions_in_flight``): a batch on other devices
commits beside one that is held up, a device's later messages wait for its earlier ones,
acknowledgements leave in delivery order whatever order the commits land in, and the
crash-loop breaker's journal holds every message of every flight.

The interleavings are forced, not timed: a row lock taken by the test holds the first
flight inside its transaction for as long as the test wants."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import msgspec
import pytest

from gateway.alarms.engine import AlarmEngine
from gateway.commands.receipts import ReceiptApplier
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.ingest.breaker import CrashLoopBreaker, digest
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.writer import IngestWriter
from gateway.support.backoff import Backoff
from gateway.support.metrics import Metrics
from protocol import Encoding, Topics
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1767225600000
RULES = compile_rules([RuleConfig(key="sos", kind="event", event="SOS", severity="CRITICAL")])


class Acks:
    """Records what the writer acknowledges, in the order it does."""

    def __init__(self) -> None:
        self.acked: list[str] = []

    def ack(self, message: object, /) -> bool:
        assert isinstance(message, str)
        self.acked.append(message)
        return True


def _writer(pool: asyncpg.Pool, in_flight: int) -> IngestWriter:
    metrics = Metrics()
    return IngestWriter(
        pool=pool,
        decoder=MessageDecoder(TOPICS, Encoding.JSON, 65536),
        node_id="node-a",
        metrics=metrics,
        batch_size=100,
        linger_s=0.0,
        queue_max=1000,
        retry=Backoff(0.01, 0.1),
        engine=AlarmEngine(rules=RULES, node_id="node-a", metrics=metrics),
        receipts=ReceiptApplier(node_id="node-a", sent_timeout_s=60, metrics=None),
        breaker=CrashLoopBreaker("node-a"),
        in_flight=in_flight,
    )


def _sos(acks: Acks, name: str) -> Inbound:
    """A message of device ``name`` before the colon; acknowledged as ``name``."""
    device, _, n = name.partition(":")
    payload = msgspec.json.encode(
        {"ts": T0 + int(n or 0), "seq": int(n or 0), "events": [{"type": "SOS"}]}
    )
    return Inbound(topic=TOPICS.telemetry(device), payload=payload, acker=acks, message=name)


@pytest.fixture
async def conn(db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(db_dsn)
    try:
        yield c
    finally:
        await c.close()


async def _stored(conn: asyncpg.Connection) -> list[tuple[str, int]]:
    rows = await conn.fetch("SELECT device_id, seq FROM telemetry ORDER BY device_id, seq")
    return [(r["device_id"], r["seq"]) for r in rows]


async def test_a_flight_on_other_devices_commits_beside_a_held_one_and_acks_wait_their_turn(
    pool: asyncpg.Pool, conn: asyncpg.Connection, db_dsn: str
) -> None:
    writer = _writer(pool, in_flight=2)
    await writer.recover()
    acks = Acks()
    task = asyncio.create_task(writer.run())
    locker = await asyncpg.connect(db_dsn)
    try:
        # dev-a exists; the test then holds its row, so the next flight with dev-a stops
        # inside its transaction (the device upsert) until the test lets it go.
        await writer.put_many([_sos(acks, "dev-a:0")])
        assert await writer.drain(30)
        lock = locker.transaction()
        await lock.start()
        await locker.execute("SELECT 1 FROM device WHERE device_id = 'dev-a' FOR UPDATE")

        await writer.put_many([_sos(acks, "dev-a:1")])

        async def held() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )

        await wait_until(held, message="the first flight waiting on dev-a's row")

        # dev-a's second message waits for its first; dev-b and dev-c go beside it.
        await writer.put_many([_sos(acks, "dev-b:1"), _sos(acks, "dev-a:2"), _sos(acks, "dev-c:1")])

        async def beside() -> bool:
            return {d for d, _ in await _stored(conn)} >= {"dev-b", "dev-c"}

        await wait_until(beside, message="dev-b and dev-c stored beside the held flight")
        assert await _stored(conn) == [("dev-a", 0), ("dev-b", 1), ("dev-c", 1)]
        # Committed, but dev-a:1 was delivered before them and is not stored yet.
        assert acks.acked == ["dev-a:0"]
        # The journal holds both flights' messages: a death now counts one for each.
        journal = await conn.fetchval("SELECT digests FROM ingest_journal WHERE node_id = 'node-a'")
        held_items = [_sos(acks, "dev-a:1"), _sos(acks, "dev-b:1"), _sos(acks, "dev-c:1")]
        assert {digest(item) for item in held_items} <= {bytes(d) for d in journal}

        await lock.rollback()
        assert await writer.drain(30)
        assert await _stored(conn) == [
            ("dev-a", 0),
            ("dev-a", 1),
            ("dev-a", 2),
            ("dev-b", 1),
            ("dev-c", 1),
        ]
        assert acks.acked == ["dev-a:0", "dev-a:1", "dev-b:1", "dev-a:2", "dev-c:1"]
        # Every SOS raised its alarm, each once.
        alarms = await conn.fetch("SELECT device_id FROM alarm ORDER BY device_id")
        assert [r["device_id"] for r in alarms] == ["dev-a", "dev-a", "dev-a", "dev-b", "dev-c"]
    finally:
        await locker.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_with_one_transaction_in_flight_nothing_passes_a_held_batch(
    pool: asyncpg.Pool, conn: asyncpg.Connection, db_dsn: str
) -> None:
    """``transactions_in_flight = 1``: the batch behind a held one waits for it, whatever
    its devices (one transaction at a time, as before the setting)."""
    writer = _writer(pool, in_flight=1)
    await writer.recover()
    acks = Acks()
    task = asyncio.create_task(writer.run())
    locker = await asyncpg.connect(db_dsn)
    try:
        await writer.put_many([_sos(acks, "dev-a:0")])
        assert await writer.drain(30)
        lock = locker.transaction()
        await lock.start()
        await locker.execute("SELECT 1 FROM device WHERE device_id = 'dev-a' FOR UPDATE")
        await writer.put_many([_sos(acks, "dev-a:1")])

        async def held() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )

        await wait_until(held, message="the flight waiting on dev-a's row")
        await writer.put_many([_sos(acks, "dev-b:1")])
        # The writer took dev-b's message off the queue only once the held flight lands.
        assert writer.queue.qsize() == 1
        assert await _stored(conn) == [("dev-a", 0)]
        await lock.rollback()
        assert await writer.drain(30)
        assert await _stored(conn) == [("dev-a", 0), ("dev-a", 1), ("dev-b", 1)]
        assert acks.acked == ["dev-a:0", "dev-a:1", "dev-b:1"]
    finally:
        await locker.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
