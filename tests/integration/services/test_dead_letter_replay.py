"""Dead letters replayed under field conditions: by two nodes at once, and through a mapping
whose payloads carry no time."""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg

from gateway.ingest import live_path
from gateway.ingest.replay import replay
from gateway.support.metrics import Metrics
from protocol import Topics
from storage import ingest as repo
from storage.ingest import DeadLetterRow
from tests.support.daemon import make_config

TOPICS = Topics("iot")
Z2M = '[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n'


async def test_a_letter_of_a_mapping_without_times_is_read_at_its_receive_time_on_every_node(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str
) -> None:
    """Zigbee2MQTT without last_seen: the time is the receive time cut to 1 s. A replay reads
    the letter at the time it was received, so every replay, on any node, is the same reading:
    it used to be read at the replay's time, stored at the wrong time and stored again by a
    second replay (another node's, or the same one's by id) in a later second."""
    topic = "zigbee2mqtt/0x00158d0001d8e1d2"
    payload = b'{"temperature": 30.5, "humidity": 50}'
    # Refused at the time (PostgreSQL away too long, say): valid bytes.
    letter = DeadLetterRow.whole(topic, payload, "STORAGE_REJECTED", "refused at the time")
    await repo.insert_dead_letters(db, [letter], "gw-1")
    received = datetime(2026, 1, 1, 12, 0, 0, 750_000, tzinfo=UTC)
    letter_id = await db.fetchval("UPDATE dead_letter SET received_at = $1 RETURNING id", received)

    outcomes = []
    for node in ("node-a", "node-b"):
        config = make_config(dsn=db_dsn, mqtt_port=1, node_id=node, extra=Z2M)
        path = live_path.for_replay(config, Metrics())
        outcomes += [o.outcome for o in await replay(pool, path, [letter_id])]

    assert outcomes == ["stored", "duplicate"]
    rows = await db.fetch("SELECT device_id, ts, metrics::text AS metrics FROM telemetry")
    assert [(r["device_id"], r["ts"]) for r in rows] == [
        ("0x00158d0001d8e1d2", datetime(2026, 1, 1, 12, 0, tzinfo=UTC))
    ]
