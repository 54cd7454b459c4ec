"""Exactly-once ingest against a real mosquitto and a real PostgreSQL."""

from __future__ import annotations

import aiomqtt
import asyncpg
import msgspec

from gateway.ingest import live_path
from gateway.ingest.replay import pending_ids, replay
from gateway.runtime.daemon import Daemon
from gateway.support.metrics import Metrics
from protocol import Topics
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream
from storage.pool import create_pool
from tests.support.daemon import count_rows, make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")


async def test_ten_thousand_messages_stored_once_and_redelivery_is_deduplicated(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port)
    stream = list(telemetry_stream(TOPICS, device_ids(100), 10_000))
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=500) as pub:
            await publish_many(pub, stream, window=500)
            await wait_until(
                lambda: metric(daemon, "gateway_telemetry_received_total") >= 10_000,
                timeout=60,
                message="first pass received",
            )
            assert await count_rows(db_dsn) == 10_000
            assert metric(daemon, "gateway_telemetry_stored_total") == 10_000

            await publish_many(pub, stream, window=500)  # the same messages again
            await wait_until(
                lambda: metric(daemon, "gateway_telemetry_received_total") >= 20_000,
                timeout=60,
                message="second pass received",
            )
        assert await count_rows(db_dsn) == 10_000
        assert metric(daemon, "gateway_telemetry_duplicates_total") == 10_000
        assert metric(daemon, "gateway_telemetry_stored_total") == 10_000

    conn = await asyncpg.connect(db_dsn)
    try:
        devices = await conn.fetch("SELECT device_id, first_seen, last_seen FROM device")
        seqs = await conn.fetchval("SELECT count(DISTINCT seq) FROM telemetry")
    finally:
        await conn.close()
    assert len(devices) == 100
    assert all(d["last_seen"] >= d["first_seen"] for d in devices)
    assert seqs == 10_000


async def test_bad_input_is_dead_lettered_and_the_messages_after_it_are_stored(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, mqtt_extra="max_payload_bytes = 2048"
    )
    good = b'{"ts": 1767225600000, "metrics": {"temp": 21.5}}'
    bad = [
        (TOPICS.telemetry("dev-1"), b'{"ts": 1767225600000, "metrics": {"temp": 21.5'),
        (TOPICS.telemetry("dev-1"), b'{"ts": "yesterday", "metrics": {"temp": 21.5}}'),
        (TOPICS.telemetry("dev-1"), b'{"ts": 1767225600000, "metrics": {"temp": "x" }, "z": 1}'),
        (
            TOPICS.telemetry("dev-1"),
            b'{"ts": 1767225600000, "metrics": {"t": "' + b"x" * 4096 + b'"}}',
        ),
        ("iot/devices/bad device!/telemetry", good),
        (TOPICS.telemetry("dev-1"), b'{"ts": 1767225600000, "metrics": {"s": "nul\\u0000"}}'),
        (TOPICS.device_status("dev-1"), b"maybe"),
    ]
    after = [
        (
            TOPICS.telemetry("dev-2"),
            msgspec.json.encode({"ts": 1767225600000 + i, "metrics": {"n": i}}),
        )
        for i in range(50)
    ]
    async with running_daemon(config) as daemon, aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
        await publish_many(pub, [*bad, *after], window=1)
        await wait_until(
            lambda: _stored_and_dead(daemon) >= (50, 7),
            timeout=30,
            message="50 stored and 7 dead letters",
        )

    conn = await asyncpg.connect(db_dsn)
    try:
        letters = await conn.fetch(
            "SELECT topic, payload, reason, detail FROM dead_letter ORDER BY id"
        )
        stored = await conn.fetchval("SELECT count(*) FROM telemetry WHERE device_id = 'dev-2'")
    finally:
        await conn.close()
    assert stored == 50
    by_payload = {(r["topic"], bytes(r["payload"])): r for r in letters}
    # One device's messages are stored (and dead-lettered) in delivery order; messages of
    # different devices may commit in either order (transactions in flight), so the bad
    # topic, which names no device, may land anywhere among dev-1's.
    assert [r["reason"] for r in letters if "/dev-1/" in r["topic"]] == [
        "MALFORMED",
        "INVALID",
        "INVALID",
        "OVERSIZED",
        "INVALID",
        "INVALID",
    ]
    assert [r["reason"] for r in letters if "/dev-1/" not in r["topic"]] == ["BAD_DEVICE_ID"]
    # The raw bytes are kept verbatim, whatever was wrong with them.
    for topic, payload in bad:
        assert (topic, payload) in by_payload
    wrong_type = by_payload[bad[1]]
    assert "$.ts" in wrong_type["detail"]
    unknown = by_payload[bad[2]]
    assert "z" in unknown["detail"]


def _stored_and_dead(daemon: Daemon) -> tuple[float, float]:
    dead = sum(
        metric(daemon, "gateway_dead_letters_total", {"reason": reason})
        for reason in ("MALFORMED", "INVALID", "OVERSIZED", "BAD_DEVICE_ID", "STORAGE_REJECTED")
    )
    return metric(daemon, "gateway_telemetry_stored_total"), dead


async def test_a_row_the_database_refuses_is_dead_lettered_without_blocking_its_batch(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    # A constraint the decoder knows nothing about stands in for any refusal PostgreSQL may
    # have for one row (the batch it is in must still commit, minus that row).
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute("ALTER TABLE telemetry ADD CONSTRAINT no_13 CHECK (seq <> 13)")
    finally:
        await conn.close()
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port)
    stream = list(telemetry_stream(TOPICS, device_ids(5), 200))
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, stream, window=200)
        await wait_until(lambda: _stored_and_dead(daemon) >= (199, 1), timeout=30)
    conn = await asyncpg.connect(db_dsn)
    try:
        letter = await conn.fetchrow("SELECT topic, payload, reason, detail FROM dead_letter")
        assert await conn.fetchval("SELECT count(*) FROM telemetry") == 199
    finally:
        await conn.close()
    assert letter["reason"] == "STORAGE_REJECTED"
    assert "no_13" in letter["detail"]
    assert (letter["topic"], bytes(letter["payload"])) == stream[13]


async def test_dead_letters_replay_through_the_normal_path_idempotently(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    small = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, mqtt_extra="max_payload_bytes = 64")
    big = msgspec.json.encode({"ts": 1767225600000, "metrics": {f"m{i}": i for i in range(20)}})
    fine = b'{"ts": 1767225600001, "metrics": {"temp": 1}}'
    async with running_daemon(small) as daemon, aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
        await publish_many(
            pub,
            [(TOPICS.telemetry("dev-9"), big), (TOPICS.telemetry("dev-9"), b"not json")],
            window=1,
        )
        await publish_many(pub, [(TOPICS.telemetry("dev-9"), fine)], window=1)
        await wait_until(lambda: _stored_and_dead(daemon) >= (1, 2), timeout=30)

    # An operator raises the limit; the oversized message now passes, the garbage does not.
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    try:
        raised = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id="replayer")
        path = live_path.for_replay(raised, Metrics())
        ids = await pending_ids(pool, None)
        first = await replay(pool, path, ids)
        assert [o.outcome for o in first] == ["stored", "still_invalid: MALFORMED"]
        assert await pending_ids(pool, None) == [ids[1]]
        # Replaying the stored one again (by id) is a harmless duplicate.
        again = await replay(pool, path, [ids[0]], again=True)
        assert [o.outcome for o in again] == ["duplicate"]
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT count(*) FROM telemetry") == 2
            rows = await conn.fetch(
                "SELECT replay_count, replay_outcome, replayed_at IS NOT NULL AS done "
                "FROM dead_letter ORDER BY id"
            )
    finally:
        await pool.close()
    assert [tuple(r) for r in rows] == [
        (2, "duplicate", True),
        (1, "still_invalid: MALFORMED", False),
    ]


async def test_poison_receipts_are_dead_lettered_and_do_not_block_the_pipeline(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port)
    acks = TOPICS.acks("dev-1")
    poison = [
        (
            acks,
            b'{"commandId": 1208925819614629174706176, "claimGeneration": 1, "result": "ACKED"}',
        ),
        (acks, b'{"commandId": 1, "claimGeneration": 4294967296, "result": "ACKED"}'),
        (acks, b'{"commandId": 1, "claimGeneration": 1, "result": "ACKED", "rawAck": "a\\u0000"}'),
    ]
    after = [(TOPICS.telemetry("dev-2"), b'{"ts": 1, "metrics": {"n": 1}}')]
    async with running_daemon(config) as daemon, aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
        await publish_many(pub, [*poison, *after], window=1)
        await wait_until(lambda: _stored_and_dead(daemon) >= (1, 3), timeout=30)
    conn = await asyncpg.connect(db_dsn)
    try:
        reasons = [r["reason"] for r in await conn.fetch("SELECT reason FROM dead_letter")]
    finally:
        await conn.close()
    assert reasons == ["INVALID", "INVALID", "INVALID"]
