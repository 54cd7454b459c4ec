"""Oversized payloads are bounded in bytes: in dead letters, and in the reader's buffer."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import aiomqtt
import asyncpg
import msgspec

from protocol import Topics
from sim.publisher import publish_many
from tests.support.daemon import count_rows, make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


async def test_an_oversized_payload_is_dead_lettered_as_a_bounded_prefix_with_size_and_hash(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    big = b'{"ts": 1767225600000, "metrics": {"blob": "' + b"x" * 99_950 + b'"}}'
    status = b"online" * 1000  # oversized on any topic: no message may be that long
    fine = b'{"ts": 1767225600001, "metrics": {"temp": 21.5}}'
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, mqtt_extra="max_payload_bytes = 1024",
        ingest_extra="dead_letter_max_bytes = 256",
    )  # fmt: skip
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(
                pub,
                [
                    (TOPICS.telemetry("dev-1"), big),
                    (TOPICS.device_status("dev-1"), status),
                    (TOPICS.telemetry("dev-1"), fine),
                ],
                window=1,
            )
        await wait_until(
            lambda: metric(daemon, "gateway_ingest_handler_seconds_count") >= 3, timeout=30
        )
        assert metric(daemon, "gateway_dead_letters_total", {"reason": "OVERSIZED"}) == 2

    conn = await asyncpg.connect(db_dsn)
    try:
        letters = await conn.fetch(
            "SELECT topic, payload, payload_size, payload_sha256, reason, detail "
            "FROM dead_letter ORDER BY id"
        )
        assert await conn.fetchval("SELECT count(*) FROM telemetry") == 1
    finally:
        await conn.close()
    assert [
        (r["topic"], bytes(r["payload"]), r["payload_size"], r["payload_sha256"], r["reason"])
        for r in letters
    ] == [
        (TOPICS.telemetry("dev-1"), big[:256], len(big), hashlib.sha256(big).hexdigest(),
         "OVERSIZED"),
        (TOPICS.device_status("dev-1"), status[:256], len(status),
         hashlib.sha256(status).hexdigest(), "OVERSIZED"),
    ]  # fmt: skip
    assert f"payload is {len(big)} bytes, the limit is 1024" in letters[0]["detail"]

    # What operators see, and that a truncated letter is not replayed from its prefix.
    config_file = tmp_path / "gateway.toml"
    config_file.write_text(f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n')
    listing = _gateway("dead-letters", "list", "--config", str(config_file), "--json")
    assert listing.returncode == 0, listing.stderr
    first = json.loads(listing.stdout.splitlines()[0])
    assert first["payload_size"] == len(big)
    assert first["payload_sha256"] == hashlib.sha256(big).hexdigest()
    assert first["truncated"] is True
    assert base64.b64decode(first["payload_base64"]) == big[:256]
    text = _gateway("dead-letters", "list", "--config", str(config_file))
    assert f"{len(big)} bytes (first 256 kept)" in text.stdout
    assert hashlib.sha256(big).hexdigest() in text.stdout
    replay = _gateway("dead-letters", "replay", "--config", str(config_file), "--all")
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout.count("\ttruncated") == 2


async def test_the_reader_pauses_on_buffered_bytes_while_the_writer_is_stuck(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    bound = 100_000
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        ingest_extra=f"batch_max = 1\nqueue_max = 2\nread_buffer_bytes = {bound}",
    )  # fmt: skip
    # Valid messages of ~30 kB: well under max_payload_bytes, far under the message bound.
    stream = [
        (
            TOPICS.telemetry("dev-1"),
            msgspec.json.encode(
                {
                    "ts": 1767225600000 + n,
                    "seq": n,
                    "metrics": {f"m{i}": "x" * 1000 for i in range(30)},
                }
            ),
        )
        for n in range(20)
    ]
    size = len(stream[0][1])
    blocker = await asyncpg.connect(db_dsn)
    try:
        async with running_daemon(config) as daemon:
            # Every insert now waits for this lock: the writer and its queue stall.
            await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
                await publish_many(pub, stream, window=20)
            session = daemon.session
            assert session is not None
            await wait_until(
                lambda: session.client is not None and session.client.reading_paused,
                timeout=30, message="reading paused",
            )  # fmt: skip
            client = session.client
            assert client is not None
            # At least once: the reader hands a few messages to the writer's queue before that
            # fills too, which can take the buffer under half and let reading resume once.
            assert metric(daemon, "gateway_mqtt_read_pauses_total", {"bound": "bytes"}) >= 1
            assert metric(daemon, "gateway_mqtt_read_pauses_total", {"bound": "messages"}) == 0
            # Paused on reaching the bound; the reader may have taken one since (it stays
            # paused down to half of it).
            assert bound // 2 < client.buffered_bytes < bound + size
            assert client.buffered < 1000  # [ingest] read_buffer, the default
            await blocker.execute("ROLLBACK")

            async def all_stored() -> bool:
                return await count_rows(db_dsn) == 20

            await wait_until(all_stored, timeout=60, message="all 20 stored")
    finally:
        await blocker.close()
