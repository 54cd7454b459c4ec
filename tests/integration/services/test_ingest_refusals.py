"""Batches PostgreSQL refuses for their content: split without losing anything, bounded when
no single message explains the refusal."""

from __future__ import annotations

import aiomqtt
import asyncpg
import msgspec

from gateway.domain.command import Delivery
from gateway.runtime.daemon import Daemon
from protocol import Topics
from sim.publisher import publish_many
from storage import commands as commands_repo
from storage.commands import CommandRow
from tests.support.commands import new_command
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
NODE = "test-node"  # make_config's node id: the node the command is claimed by


def _one_batch(size: int, extra: str = "") -> str:
    # The batch closes when its last message arrives: all of them are in the same transaction.
    return f"batch_max = {size}\nlinger_ms = 10000\n{extra}"


def _acked(daemon: Daemon) -> float:
    return metric(daemon, "gateway_ingest_handler_seconds_count")


def _telemetry(device: str, seq: int) -> tuple[str, bytes]:
    payload = msgspec.json.encode({"ts": 1767225600000 + seq, "seq": seq, "metrics": {"n": seq}})
    return TOPICS.telemetry(device), payload


async def _claimed_command(conn: asyncpg.Connection, device: str) -> CommandRow:
    created = await new_command(
        conn, device_id=device, name="open_valve", params={"valve": 1},
        delivery=Delivery.REALTIME, idempotency_key=None, actor="op:test", node_id="api",
        expire_after_s=3600,
    )  # fmt: skip
    (claimed,) = await commands_repo.claim_due(
        conn, node_id=NODE, lease_s=600, limit=10, max_in_flight=1, actor="system:dispatcher"
    )
    assert claimed.id == created.command.id
    return claimed


def _receipt(command: CommandRow, device: str, raw_ack: str = "done") -> tuple[str, bytes]:
    body = {
        "commandId": command.id, "claimGeneration": command.claim_generation,
        "nodeId": NODE, "result": "ACKED", "resultCode": 0, "rawAck": raw_ack,
    }  # fmt: skip
    return TOPICS.acks(device), msgspec.json.encode(body)


async def test_a_receipt_in_a_batch_split_for_a_refused_row_is_applied(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        # A constraint the decoder knows nothing about: PostgreSQL refuses this one row.
        await conn.execute("ALTER TABLE telemetry ADD CONSTRAINT no_13 CHECK (seq <> 13)")
        command = await _claimed_command(conn, "valve-1")
    finally:
        await conn.close()
    refused, fine = _telemetry("valve-1", 13), _telemetry("valve-1", 14)
    receipt = _receipt(command, "valve-1")
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, ingest_extra=_one_batch(3))
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, [refused, receipt, fine], window=3)
        await wait_until(lambda: _acked(daemon) >= 3, timeout=30, message="all 3 acknowledged")
        assert metric(daemon, "gateway_ingest_batch_size_count") == 1  # one batch it was
        split = metric(daemon, "gateway_ingest_batch_refusals_total", {"explained": "true"})

    conn = await asyncpg.connect(db_dsn)
    try:
        receipts = await conn.fetch("SELECT command_id, outcome FROM command_receipt")
        status = await conn.fetchval("SELECT status FROM command WHERE id = $1", command.id)
        letters = await conn.fetch("SELECT topic, payload, reason, detail FROM dead_letter")
        seqs = await conn.fetch("SELECT seq FROM telemetry")
    finally:
        await conn.close()
    assert [tuple(r) for r in receipts] == [(command.id, "accepted")]
    assert status == "ACKED"
    assert [(r["topic"], bytes(r["payload"]), r["reason"]) for r in letters] == [
        (*refused, "STORAGE_REJECTED")
    ]
    assert "no_13" in letters[0]["detail"]
    assert [r["seq"] for r in seqs] == [14]
    assert split == 1


async def test_a_receipt_postgres_refuses_is_dead_lettered_and_its_batch_stored(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "ALTER TABLE command_receipt ADD CONSTRAINT no_poison "
            "CHECK (raw_ack IS DISTINCT FROM 'poison')"
        )
        command = await _claimed_command(conn, "valve-2")
    finally:
        await conn.close()
    poison = _receipt(command, "valve-2", raw_ack="poison")
    fine = _telemetry("valve-2", 1)
    online = (TOPICS.device_status("valve-2"), b"online")
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, ingest_extra=_one_batch(3))
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, [fine, poison, online], window=3)
        await wait_until(lambda: _acked(daemon) >= 3, timeout=30, message="all 3 acknowledged")

    conn = await asyncpg.connect(db_dsn)
    try:
        letters = await conn.fetch("SELECT topic, payload, reason, detail FROM dead_letter")
        stored = await conn.fetchval("SELECT count(*) FROM telemetry")
        presence = await conn.fetchval("SELECT presence FROM device WHERE device_id = 'valve-2'")
        status = await conn.fetchval("SELECT status FROM command WHERE id = $1", command.id)
    finally:
        await conn.close()
    assert [(r["topic"], bytes(r["payload"]), r["reason"]) for r in letters] == [
        (*poison, "STORAGE_REJECTED")
    ]
    assert "no_poison" in letters[0]["detail"]
    assert stored == 1
    assert presence == "online"
    assert status == "CLAIMED"  # the refused receipt changed nothing


ONE_ROW_AT_A_TIME = """
CREATE FUNCTION one_row_at_a_time() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT count(*) FROM fresh) > 1 THEN
        RAISE EXCEPTION 'at most one telemetry row per statement';
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER one_row_at_a_time AFTER INSERT ON telemetry
    REFERENCING NEW TABLE AS fresh FOR EACH STATEMENT EXECUTE FUNCTION one_row_at_a_time();
"""


async def test_a_refusal_no_single_message_explains_is_retried_a_bounded_number_of_times(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    # Each message passes alone; only the batch is refused: nothing to split it by.
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(ONE_ROW_AT_A_TIME)
    finally:
        await conn.close()
    first = [_telemetry("dev-1", 1), _telemetry("dev-2", 2)]
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        ingest_extra=_one_batch(2, "refused_batch_attempts = 3"),
    )  # fmt: skip
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, first, window=2)
            await wait_until(lambda: _acked(daemon) >= 2, timeout=30, message="dead-lettered")
            unexplained = {"explained": "false"}
            assert metric(daemon, "gateway_ingest_batch_refusals_total", unexplained) == 3
            assert metric(daemon, "gateway_dead_letters_total", {"reason": "STORAGE_REJECTED"}) == 2

            # The writer goes on with the next batches.
            conn = await asyncpg.connect(db_dsn)
            try:
                await conn.execute("DROP TRIGGER one_row_at_a_time ON telemetry")
            finally:
                await conn.close()
            await publish_many(pub, [_telemetry("dev-1", 3), _telemetry("dev-2", 4)], window=2)
            await wait_until(lambda: _acked(daemon) >= 4, timeout=30, message="stored after")
        assert metric(daemon, "gateway_telemetry_stored_total") == 2

    conn = await asyncpg.connect(db_dsn)
    try:
        letters = await conn.fetch("SELECT topic, payload, reason, detail FROM dead_letter")
        seqs = await conn.fetch("SELECT seq FROM telemetry ORDER BY seq")
    finally:
        await conn.close()
    assert sorted((r["topic"], bytes(r["payload"])) for r in letters) == sorted(first)
    assert {r["reason"] for r in letters} == {"STORAGE_REJECTED"}
    assert all("refused 3 times" in r["detail"] for r in letters)
    assert all("at most one telemetry row" in r["detail"] for r in letters)
    assert [r["seq"] for r in seqs] == [3, 4]


async def test_a_dead_letter_whose_detail_quotes_a_nul_is_stored(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    # The decoder names the unknown field, NUL included; PostgreSQL text cannot hold a NUL.
    nul_field = (TOPICS.telemetry("dev-1"), b'{"ts": 1, "metrics": {"a": 1}, "b\\u0000": 1}')
    after = _telemetry("dev-1", 2)
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port)
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, [nul_field, after], window=1)
        await wait_until(lambda: _acked(daemon) >= 2, timeout=30, message="both acknowledged")
    conn = await asyncpg.connect(db_dsn)
    try:
        letter = await conn.fetchrow("SELECT payload, reason, detail FROM dead_letter")
        stored = await conn.fetchval("SELECT count(*) FROM telemetry")
    finally:
        await conn.close()
    assert (bytes(letter["payload"]), letter["reason"]) == (nul_field[1], "INVALID")
    assert "b\\u0000" in letter["detail"]
    assert stored == 1
