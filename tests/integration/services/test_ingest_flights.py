"""Two transactions in flight (``[ingest] transactions_in_flight``): a batch on other devices
commits beside one that is held up, a device's later messages wait for its earlier ones,
acknowledgements leave in delivery order whatever order the commits land in, and the
crash-loop breaker's journal holds every message of every flight.

The interleavings are forced, not timed: a row lock taken by the test holds the first
flight inside its transaction for as long as the test wants."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg
import msgspec
import pytest

from gateway.alarms.engine import AlarmEngine
from gateway.commands.receipts import ReceiptApplier
from gateway.config import parse_config
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.ingest.breaker import CrashLoopBreaker, digest
from gateway.ingest.decoder import Classified, Inbound, MessageDecoder
from gateway.ingest.live_path import message_decoder
from gateway.ingest.store import StoreResult
from gateway.ingest.writer import IngestWriter
from gateway.support.backoff import Backoff
from gateway.support.metrics import Metrics
from protocol import Encoding, Topics
from tests.support.journal import journal_digests
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


class BuggyCounting(IngestWriter):
    """The real writer, with a bug after the commit of a batch holding device "boom"."""

    def _count(self, result: StoreResult, batch: Classified, *, received: int) -> None:
        if any("/boom/" in item.topic for item in batch.items):
            raise RuntimeError("a bug after the commit")
        super()._count(result, batch, received=received)


# A vendor mapping that reads the device id from the payload: a barrier.
BOILER = """
[[ingest.mappings]]
name = "boiler"
topic = "plant/{site}/boiler/{unit}/state"
device_path = "$.serial"
timestamp_path = "$.at"
timestamp_format = "epoch_ms"
[[ingest.mappings.metrics]]
path = "$.t"
name = "t"
"""


def _writer(
    pool: asyncpg.Pool,
    in_flight: int,
    *,
    kind: type[IngestWriter] = IngestWriter,
    decoder: MessageDecoder | None = None,
) -> IngestWriter:
    metrics = Metrics()
    return kind(
        pool=pool,
        decoder=decoder or MessageDecoder(TOPICS, Encoding.JSON, 65536),
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


async def _stored(conn: asyncpg.Connection) -> list[tuple[str, int | None]]:
    rows = await conn.fetch("SELECT device_id, seq FROM telemetry ORDER BY device_id, seq")
    return [(r["device_id"], r["seq"]) for r in rows]


@contextlib.asynccontextmanager
async def _running(writer: IngestWriter, db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """The writer's own loop running, and a connection of the test's to hold rows with."""
    await writer.recover()
    task = asyncio.create_task(writer.run())
    locker = await asyncpg.connect(db_dsn)
    try:
        yield locker
    finally:
        await locker.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def _held_on_dev_a(
    writer: IngestWriter, acks: Acks, conn: asyncpg.Connection, locker: asyncpg.Connection
) -> asyncpg.transaction.Transaction:
    """dev-a:0 stored, then dev-a:1 in a flight held inside its transaction (locking its
    rule state) by the row lock of the transaction returned: rolling it back lets it go on."""
    await writer.put_many([_sos(acks, "dev-a:0")])
    assert await writer.drain(30)
    lock = locker.transaction()
    await lock.start()
    assert await locker.fetchval(
        "SELECT count(*) FROM (SELECT FROM rule_state WHERE device_id = 'dev-a' FOR UPDATE) s"
    )
    await writer.put_many([_sos(acks, "dev-a:1")])

    async def held() -> bool:
        return bool(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        )

    await wait_until(held, message="the flight waiting on dev-a's row")
    return lock


async def test_a_flight_on_other_devices_commits_beside_a_held_one_and_acks_wait_their_turn(
    pool: asyncpg.Pool, conn: asyncpg.Connection, db_dsn: str
) -> None:
    writer, acks = _writer(pool, in_flight=2), Acks()
    async with _running(writer, db_dsn) as locker:
        lock = await _held_on_dev_a(writer, acks, conn, locker)
        # dev-a's second message waits for its first; dev-b and dev-c go beside it.
        await writer.put_many([_sos(acks, "dev-b:1"), _sos(acks, "dev-a:2"), _sos(acks, "dev-c:1")])

        async def beside() -> bool:
            return {d for d, _ in await _stored(conn)} >= {"dev-b", "dev-c"}

        await wait_until(beside, message="dev-b and dev-c stored beside the held flight")
        assert await _stored(conn) == [("dev-a", 0), ("dev-b", 1), ("dev-c", 1)]
        # Committed, but dev-a:1 was delivered before them and is not stored yet.
        assert acks.acked == ["dev-a:0"]
        # The journal holds both flights' messages: a death now counts one for each.
        journal = set(await journal_digests(conn, "node-a"))
        held_items = [_sos(acks, "dev-a:1"), _sos(acks, "dev-b:1"), _sos(acks, "dev-c:1")]
        assert {digest(item) for item in held_items} <= journal

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


async def test_with_one_transaction_in_flight_nothing_passes_a_held_batch(
    pool: asyncpg.Pool, conn: asyncpg.Connection, db_dsn: str
) -> None:
    """``transactions_in_flight = 1``: the batch behind a held one waits for it, whatever
    its devices (one transaction at a time, as before the setting)."""
    writer, acks = _writer(pool, in_flight=1), Acks()
    async with _running(writer, db_dsn) as locker:
        lock = await _held_on_dev_a(writer, acks, conn, locker)
        await writer.put_many([_sos(acks, "dev-b:1")])
        assert await _stored(conn) == [("dev-a", 0)]
        # A round trip later, dev-b's message is still queued: the writer takes the next
        # batch only once the held one lands (with two in flight it would be stored by now).
        assert writer.queue.qsize() == 1
        await lock.rollback()
        assert await writer.drain(30)
        assert await _stored(conn) == [("dev-a", 0), ("dev-a", 1), ("dev-b", 1)]
        assert acks.acked == ["dev-a:0", "dev-a:1", "dev-b:1"]


async def test_a_barrier_waits_for_every_flight_and_what_follows_it_waits_for_it(
    pool: asyncpg.Pool, conn: asyncpg.Connection, db_dsn: str
) -> None:
    """A mapping naming its device from the payload: nothing is stored beside it."""
    decoder = message_decoder(parse_config(BOILER))
    writer, acks = _writer(pool, in_flight=2, decoder=decoder), Acks()
    async with _running(writer, db_dsn) as locker:
        lock = await _held_on_dev_a(writer, acks, conn, locker)
        boiler = Inbound(
            "plant/north/boiler/1/state",
            msgspec.json.encode({"serial": "boiler-7", "at": T0, "t": 1.5}),
            acker=acks,
            message="boiler-7",
        )
        await writer.put_many([boiler, _sos(acks, "dev-c:1")])
        assert await _stored(conn) == [("dev-a", 0)]
        await wait_until(lambda: writer.queue.qsize() == 0, message="both taken")
        # Taken and planned: the barrier waits for dev-a's flight, dev-c for the barrier.
        assert len(writer._flights) == 1
        assert acks.acked == ["dev-a:0"]
        await lock.rollback()
        assert await writer.drain(30)
        assert await _stored(conn) == [
            ("boiler-7", None),
            ("dev-a", 0),
            ("dev-a", 1),
            ("dev-c", 1),
        ]
        assert acks.acked == ["dev-a:0", "dev-a:1", "boiler-7", "dev-c:1"]


async def test_a_flight_that_fails_on_a_bug_stays_unacknowledged_and_the_rest_go_on(
    pool: asyncpg.Pool, conn: asyncpg.Connection, db_dsn: str
) -> None:
    """Its messages are left for the broker to deliver again; the ones delivered before and
    after them are acknowledged in order, and the queue drains."""
    writer, acks = _writer(pool, in_flight=2, kind=BuggyCounting), Acks()
    async with _running(writer, db_dsn) as locker:
        lock = await _held_on_dev_a(writer, acks, conn, locker)
        await writer.put_many([_sos(acks, "boom:1"), _sos(acks, "dev-c:1")])

        async def beside() -> bool:
            return {d for d, _ in await _stored(conn)} >= {"boom", "dev-c"}

        await wait_until(beside, message="the failing flight committed beside the held one")
        await lock.rollback()
        await writer.put_many([_sos(acks, "dev-d:1")])
        assert await writer.drain(30)
        assert acks.acked == ["dev-a:0", "dev-a:1", "dev-d:1"]
        assert writer.metrics.registry.get_sample_value("gateway_ingest_inflight") == 0
