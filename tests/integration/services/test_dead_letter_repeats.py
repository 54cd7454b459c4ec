"""The same bad bytes on the same topic make one dead letter, counted at every repeat."""

from __future__ import annotations

import aiomqtt
import asyncpg

from gateway.ingest import live_path
from gateway.ingest.replay import replay
from gateway.support.metrics import Metrics
from protocol import Topics
from storage import ingest as repo
from storage.ingest import DeadLetterRow
from storage.migrate import migrate
from storage.pool import create_pool
from tests.support.daemon import count_rows, make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.schema import schema_before
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
FOLDING_MIGRATION = 8


async def test_a_retained_invalid_message_is_one_dead_letter_seen_at_every_restart(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    topic = TOPICS.device_status("dev-1")
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
        await pub.publish(topic, b"maybe", qos=1, retain=True)
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port)
    # The first start and three restarts: the broker sends the retained message each time.
    for start in range(1, 5):
        async with running_daemon(config) as daemon:
            await wait_until(
                lambda d=daemon: metric(d, "gateway_dead_letters_total", {"reason": "INVALID"}),
                timeout=30, message=f"dead-lettered at start {start}",
            )  # fmt: skip
        letters = await count_rows(db_dsn, "dead_letter")
        assert letters == 1, f"{letters} dead letters for one retained message after {start} starts"

    conn = await asyncpg.connect(db_dsn)
    try:
        (letter,) = await conn.fetch(
            "SELECT topic, payload, reason, seen_count, received_at, last_seen_at FROM dead_letter"
        )
    finally:
        await conn.close()
    assert (letter["topic"], bytes(letter["payload"]), letter["reason"]) == (
        topic, b"maybe", "INVALID",
    )  # fmt: skip
    assert letter["seen_count"] == 4
    assert letter["last_seen_at"] > letter["received_at"]


async def test_repeats_count_on_the_pending_letter_and_start_a_new_one_once_replayed(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    topic = TOPICS.telemetry("dev-1")
    oversized = b'{"ts": 1767225600000, "metrics": {"temp": 21.5}}'
    letter = DeadLetterRow.whole(topic, oversized, "OVERSIZED", "payload is 48 bytes")
    other = DeadLetterRow.whole(topic, b"garbage", "MALFORMED", "not JSON")
    # Twice in one batch, once more later: one letter seen three times.
    await repo.insert_dead_letters(db, [letter, other, letter], "n1")
    await repo.insert_dead_letters(db, [letter], "n2")
    rows = await db.fetch("SELECT id, payload, seen_count FROM dead_letter ORDER BY id")
    assert [(bytes(r["payload"]), r["seen_count"]) for r in rows] == [
        (oversized, 3),
        (b"garbage", 1),
    ]

    # Replayed with a larger limit it is stored; the same bytes arriving again (with the old
    # limit) make a new pending letter, and replaying that one is a harmless duplicate.
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    try:
        path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1), Metrics())
        assert [o.outcome for o in await replay(pool, path, [rows[0]["id"]])] == ["stored"]
        await repo.insert_dead_letters(db, [letter, letter], "n1")
        fresh = await db.fetch(
            "SELECT id, seen_count FROM dead_letter WHERE replayed_at IS NULL AND payload = $1",
            oversized,
        )
        assert [r["seen_count"] for r in fresh] == [2]
        assert fresh[0]["id"] != rows[0]["id"]
        again = await replay(pool, path, [fresh[0]["id"]])
        assert [o.outcome for o in again] == ["duplicate"]
    finally:
        await pool.close()
    assert await db.fetchval("SELECT count(*) FROM dead_letter") == 3


async def test_the_migration_folds_pending_duplicates_into_the_oldest(empty_db_dsn: str) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        # The schema as it was before 0008, with the duplicates it let pile up.
        await schema_before(conn, FOLDING_MIGRATION)
        await conn.execute(
            "INSERT INTO dead_letter (topic, payload, reason, detail, node_id, received_at, "
            "replayed_at) VALUES "
            "('t/a', 'x', 'INVALID', 'first', 'n1', '2026-01-01', NULL), "
            "('t/a', 'x', 'INVALID', 'again', 'n2', '2026-01-03', NULL), "
            "('t/a', 'x', 'INVALID', 'again', 'n1', '2026-01-02', NULL), "
            "('t/a', 'x', 'INVALID', 'replayed', 'n1', '2026-01-04', '2026-01-05'), "
            "('t/b', 'x', 'INVALID', 'other topic', 'n1', '2026-01-01', NULL), "
            "('t/a', 'y', 'INVALID', 'other bytes', 'n1', '2026-01-01', NULL)"
        )
        assert FOLDING_MIGRATION in await migrate(conn)
        rows = await conn.fetch(
            "SELECT detail, seen_count, last_seen_at::date::text AS last, payload_size "
            "FROM dead_letter ORDER BY id"
        )
    finally:
        await conn.close()
    assert [tuple(r) for r in rows] == [
        ("first", 3, "2026-01-03", 1),
        ("replayed", 1, "2026-01-04", 1),
        ("other topic", 1, "2026-01-01", 1),
        ("other bytes", 1, "2026-01-01", 1),
    ]
