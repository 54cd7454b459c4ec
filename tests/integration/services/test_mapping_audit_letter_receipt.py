"""Audit: a mapped reading without a time of its own is dated when the node received it, even
when it waited in the node's queue (a database outage) — and so must its dead letter be: a
letter is replayed "at the time it was received" (docs/devices.md), its ``received_at``. That
column was the time of the dead letter's INSERT, when the database came back: a Zigbee2MQTT
reading refused by its mapping after waiting out an outage was replayed, once the mapping was
fixed, dated at the outage's end instead of when the device sent it."""

from __future__ import annotations

import time

import asyncpg
import msgspec

from gateway.config import parse_config
from gateway.ingest import live_path
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.replay import pending_ids, replay
from gateway.support.metrics import Metrics
from tests.integration.services.test_mapping_records import (
    TOPICS,
    Clock,
    _running,
    _stored,
    _writer,
)
from tests.support.daemon import make_config

# A mistake in the mapping: the sensor's one value left out, every reading refused as empty.
WRONG = '[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\nexclude = ["temperature"]\n'
FIXED = '[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n'
# How long before it was stored the reading came (the node waited for the database).
WAITED_S = 120.0


async def test_a_letter_that_waited_in_the_queue_is_replayed_at_its_receipt(
    pool: asyncpg.Pool, db: asyncpg.Connection, db_dsn: str
) -> None:
    writer = _writer(pool, Clock())
    writer.decoder = MessageDecoder(
        TOPICS, writer.decoder.encoding, 65536, mappings=parse_config(WRONG).mappings()
    )
    came = time.monotonic() - WAITED_S
    assert came > 0, "the machine's monotonic clock started less than WAITED_S ago"
    reading = Inbound(
        topic="zigbee2mqtt/0x00158d0001d8e1d2",
        payload=msgspec.json.encode({"temperature": 21.5}),
        received_at=came,
    )
    async with _running(writer):
        await _stored(writer, reading)
    age = await db.fetchval("SELECT extract(epoch FROM now() - received_at) FROM dead_letter")
    assert float(age) >= WAITED_S - 5, f"letter received {float(age):.1f} s ago"

    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, extra=FIXED), Metrics())
    outcomes = await replay(pool, path, await pending_ids(pool, None))
    assert [o.outcome for o in outcomes] == ["stored"]
    dated = await db.fetchval("SELECT extract(epoch FROM now() - ts) FROM telemetry")
    assert float(dated) >= WAITED_S - 5, f"the reading dated {float(dated):.1f} s ago"
