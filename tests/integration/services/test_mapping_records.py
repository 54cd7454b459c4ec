"""Which mapping each mapped device was read through (device_mapping, what its commands are
rendered from), recorded by the writer's batches only when due: a device new to the node, a
changed mapping or topic, a record older than REFRESH_S. An unchanged device is not even
locked; a record rolled back is recorded by the next batch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import msgspec
import pytest

from gateway.config import parse_config
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.mapping_memory import REFRESH_S, MappingMemory
from gateway.ingest.writer import IngestWriter
from gateway.support.backoff import Backoff
from gateway.support.metrics import Metrics
from protocol import Encoding, Topics

TOPICS = Topics("iot")


def _tasmota(name: str) -> MessageDecoder:
    toml = f'[[ingest.mappings]]\nname = "{name}"\nprofile = "tasmota"\n'
    return MessageDecoder(TOPICS, Encoding.JSON, 65536, mappings=parse_config(toml).mappings())


def _sensor(device: str, second: int) -> Inbound:
    payload = {"Time": f"2026-01-01T00:00:{second:02d}", "AM2301": {"Temperature": 21.5}}
    return Inbound(topic=f"tele/{device}/SENSOR", payload=msgspec.json.encode(payload))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def _running(writer: IngestWriter) -> AsyncIterator[IngestWriter]:
    task = asyncio.create_task(writer.run())
    try:
        yield writer
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def _stored(writer: IngestWriter, *items: Inbound) -> None:
    """One batch through the writer's own loop, until stored and acknowledged."""
    await writer.put_many(list(items))
    assert await writer.drain(30)


def _writer(pool: asyncpg.Pool, clock: Clock, mapping: str = "m") -> IngestWriter:
    writer = IngestWriter(
        pool=pool,
        decoder=_tasmota(mapping),
        node_id="node-a",
        metrics=Metrics(),
        batch_size=100,
        linger_s=0.0,
        queue_max=1000,
        retry=Backoff(0.01, 0.1),
    )
    writer.mapping_memory = MappingMemory(clock=clock)
    return writer


async def _record(db: asyncpg.Connection, device: str) -> tuple[str, str, bool] | None:
    """The device's record: its mapping, its wildcards, and whether a transaction has locked
    or written it since it was inserted (its xmax)."""
    row = await db.fetchrow(
        "SELECT mapping, captures::text AS captures, xmax::text <> '0' AS touched"
        " FROM device_mapping WHERE device_id = $1",
        device,
    )
    return None if row is None else (row["mapping"], row["captures"], row["touched"])


async def test_a_mapped_device_is_recorded_again_only_when_changed_or_due(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    clock = Clock()
    writer = _writer(pool, clock)
    async with _running(writer):
        await _stored(writer, _sensor("kitchen", 0))
        assert await _record(db, "kitchen") == ("m", '{"device": "kitchen"}', False)

        # Heard from again: its record is left alone, not even locked (an INSERT … ON
        # CONFLICT DO UPDATE would lock it, though its WHERE writes nothing). A device new
        # to the node in the same batch is recorded.
        await _stored(writer, _sensor("kitchen", 1), _sensor("hall", 1))
        assert await _record(db, "kitchen") == ("m", '{"device": "kitchen"}', False)
        assert await _record(db, "hall") == ("m", '{"device": "hall"}', False)

        # Another node's record (a rolling reload), or one a failover lost: left as found
        # until REFRESH_S after this node's own, then this node's again.
        await db.execute("UPDATE device_mapping SET mapping = 'other' WHERE device_id = 'kitchen'")
        clock.now += REFRESH_S - 1
        await _stored(writer, _sensor("kitchen", 2))
        assert (await _record(db, "kitchen") or ("",))[0] == "other"
        clock.now += 1
        await _stored(writer, _sensor("kitchen", 3))
        assert (await _record(db, "kitchen") or ("",))[0] == "m"

        # A reload that reads it through another mapping: recorded with the next batch.
        writer.decoder.mappings = _tasmota("m2").mappings
        await _stored(writer, _sensor("kitchen", 4), _sensor("hall", 4))
        assert (await _record(db, "kitchen") or ("",))[0] == "m2"
        assert (await _record(db, "hall") or ("",))[0] == "m2"
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 7


REFUSE_KITCHEN_AT_COMMIT = """
CREATE FUNCTION refuse_kitchen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.device_id = 'kitchen' THEN
        RAISE EXCEPTION 'kitchen refused' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER refuse_kitchen AFTER INSERT ON device_mapping
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_kitchen();
"""


async def test_a_record_rolled_back_is_recorded_by_the_next_batch(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """The node remembers what it committed, never what a batch rolled back tried: here the
    batch's every statement succeeds and its commit is refused (a deferred trigger), until
    the writer dead-letters the batch; once the database takes the record, the kitchen's
    next message records it."""
    await db.execute(REFUSE_KITCHEN_AT_COMMIT)
    writer = _writer(pool, Clock())
    async with _running(writer):
        await _stored(writer, _sensor("kitchen", 0), _sensor("hall", 0))
        assert await _record(db, "kitchen") is None
        assert await _record(db, "hall") is None
        assert await db.fetchval("SELECT count(*) FROM dead_letter") == 2

        await db.execute("DROP TRIGGER refuse_kitchen ON device_mapping")
        await _stored(writer, _sensor("kitchen", 1), _sensor("hall", 1))
        assert await _record(db, "kitchen") == ("m", '{"device": "kitchen"}', False)
        assert await _record(db, "hall") == ("m", '{"device": "hall"}', False)
