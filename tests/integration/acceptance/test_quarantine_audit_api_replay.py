"""A QUARANTINED letter replayed over HTTP must never take the daemon down with it.

Such a letter is a message that was in flight at two deaths of the process in a row (the
crash-loop breaker): what kills the process is beyond any ``except`` (a crash in a C
extension, memory, ``os._exit``). `POST /dead-letters/{id}/replay` (the console's Replay)
replayed it inside the running daemon: with the cause not fixed — which only a replay can
tell — one click killed the node serving ingest for the fleet. It is replayed in a process of
its own (the daemon's program, as `gateway dead-letters replay --id N` with its configuration
file): a death there answers 422 `REPLAY_CRASHED` naming how that process ended, the letter
is unchanged, and the node goes on. With the cause fixed the replay stores it, as before.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import aiohttp
import aiomqtt
import asyncpg
import msgspec

from gateway.ingest.breaker import digest
from gateway.ingest.decoder import Inbound
from protocol import Topics
from tests.support.api_client import ADMIN
from tests.support.daemon import DaemonProcess, config_toml, http_healthy
from tests.support.dying_gateway import DEADLY_WHILE_DECODING, DEATH_CODE, SEGFAULT_WHILE_DECODING
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1767225600000  # 2026-01-01T00:00:00Z
NODE = "replaying-node"
KILLER = msgspec.json.encode(
    {"ts": T0, "metrics": {"t": 1, "note": DEADLY_WHILE_DECODING.decode()}}
)
SEGFAULT = msgspec.json.encode(
    {"ts": T0 + 1, "metrics": {"t": 2, "note": SEGFAULT_WHILE_DECODING.decode()}}
)


async def _fetchval(dsn: str, sql: str, *args: object) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def _wait_healthy(process: DaemonProcess, port: int) -> None:
    async def ready() -> bool:
        assert process.alive(), f"daemon exited:\n{process.log_tail()}"
        return await http_healthy(port)

    await wait_until(ready, timeout=60, message="daemon healthy")


async def _replay(port: int, letter_id: int) -> tuple[int, Any]:
    """The answer to the replay; (0, why) when the daemon went away without one."""
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"http://127.0.0.1:{port}/dead-letters/{letter_id}/replay",
                headers={"Authorization": f"Bearer {ADMIN}"},
            ) as response,
        ):
            return response.status, await response.json(content_type=None)
    except aiohttp.ClientConnectionError as exc:
        return 0, {"error": repr(exc)}


async def _still_alive(process: DaemonProcess, status: int) -> None:
    if status == 0:  # no answer: the daemon went away, or is going
        await wait_until(lambda: not process.alive(), timeout=30, message="the daemon gone")
    assert process.alive(), f"the replay killed the daemon: exit code {process.exit_code()}"


async def _publish(port: int, device: str, payload: bytes) -> None:
    async with aiomqtt.Client("127.0.0.1", port) as pub:
        await pub.publish(TOPICS.telemetry(device), payload, qos=1)


async def _stored(dsn: str, device: str) -> bool:
    count = await _fetchval(dsn, "SELECT count(*) FROM telemetry WHERE device_id = $1", device)
    return bool(count)


async def _letter(dsn: str, letter_id: int) -> tuple[Any, ...]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT reason, replay_count, replay_outcome FROM dead_letter WHERE id = $1",
            letter_id,
        )
    finally:
        await conn.close()
    return tuple(row)


async def _insert_quarantined(dsn: str, topic: str, payload: bytes) -> int:
    letter_id: int = await _fetchval(
        dsn,
        "INSERT INTO dead_letter (topic, payload, reason, detail, node_id, payload_size, "
        "payload_sha256) VALUES ($1, $2, 'QUARANTINED', 'held', $3, $4, $5) RETURNING id",
        topic,
        payload,
        NODE,
        len(payload),
        hashlib.sha256(payload).hexdigest(),
    )
    return letter_id


async def test_replaying_a_quarantined_letter_over_http_never_kills_the_daemon(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            http_port=http_port,
            node_id=NODE,
            extra=f'[[api.tokens]]\ntoken = "{ADMIN}"\nrole = "admin"\nname = "root"\n',
        )
    )
    # The cause not fixed: a daemon whose process dies on the killer's bytes (and segfaults on
    # the second letter's), as a crash in a C extension would.
    dying = DaemonProcess(config, tmp_path / "dying.log", module="tests.support.dying_gateway")
    fixed = DaemonProcess(config, tmp_path / "fixed.log")
    try:
        # Quarantined for real: two deaths in a row with it in flight, then set aside.
        dying.start()
        await _wait_healthy(dying, http_port)
        await _publish(mosquitto.port, "killer", KILLER)
        for death in ("first", "second"):
            await wait_until(lambda: not dying.alive(), timeout=60, message=f"{death} death")
            assert dying.exit_code() == DEATH_CODE
            dying.start()
        await _wait_healthy(dying, http_port)

        async def quarantined() -> bool:
            reason = await _fetchval(db_dsn, "SELECT reason FROM dead_letter")
            return reason == "QUARANTINED"

        await wait_until(quarantined, timeout=60, message="the killer quarantined")
        letter_id: int = await _fetchval(db_dsn, "SELECT id FROM dead_letter")

        # The operator clicks Replay: the cause is not fixed.
        status, body = await _replay(http_port, letter_id)
        await _still_alive(dying, status)
        assert (status, body["error"]) == (422, "REPLAY_CRASHED"), body
        assert body["dead_letter_id"] == letter_id
        assert f"exited with code {DEATH_CODE}" in body["ended"], body
        assert await _letter(db_dsn, letter_id) == ("QUARANTINED", 0, None)
        # The node goes on: healthy, and ingesting.
        assert await http_healthy(http_port)
        await _publish(
            mosquitto.port, "after-replay", msgspec.json.encode({"ts": T0, "metrics": {"t": 3}})
        )
        await wait_until(
            lambda: _stored(db_dsn, "after-replay"), timeout=30, message="ingest goes on"
        )

        # A crash by a signal (a segfault in a C extension) is named as such.
        segfault_id = await _insert_quarantined(db_dsn, TOPICS.telemetry("segv"), SEGFAULT)
        status, body = await _replay(http_port, segfault_id)
        await _still_alive(dying, status)
        assert (status, body["error"]) == (422, "REPLAY_CRASHED"), body
        assert "killed by signal 11 (SIGSEGV)" in body["ended"], body
        assert await _letter(db_dsn, segfault_id) == ("QUARANTINED", 0, None)
        assert '"dead_letter_replay_crashed"' in dying.log_text()
        assert dying.terminate() == 0

        # The cause fixed (this release does not die on those bytes): the replay stores it,
        # and the breaker forgets the message.
        fixed.start()
        await _wait_healthy(fixed, http_port)
        status, body = await _replay(http_port, letter_id)
        assert (status, body) == (
            200,
            {"dead_letter_id": letter_id, "outcome": "stored", "succeeded": True},
        ), body
        assert fixed.alive()
        assert await _stored(db_dsn, "killer")
        assert await _letter(db_dsn, letter_id) == ("QUARANTINED", 1, "stored")
        killer = digest(Inbound(TOPICS.telemetry("killer"), KILLER))
        assert not await _fetchval(
            db_dsn, "SELECT count(*) FROM ingest_suspect WHERE digest = $1", killer
        )
        # The one that segfaulted too.
        status, body = await _replay(http_port, segfault_id)
        assert (status, body["outcome"], body["succeeded"]) == (200, "stored", True), body
        assert fixed.terminate() == 0
    finally:
        dying.cleanup()
        fixed.cleanup()
