"""A rolling upgrade: two `gateway run` nodes in a `$share` group, QoS 1 telemetry flowing, and
a newer release migrates the schema under them. Each old node stops by itself within seconds,
as at SIGTERM, with one critical line saying what to do and an exit status the units restart
(not 2); nothing it held unacknowledged is lost: the nodes of a release that knows the schema,
started on the same sessions, store every message once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiomqtt
import asyncpg
import msgspec

from gateway.runtime.schema_watch import EXIT_SCHEMA_UPGRADED
from protocol import Telemetry, Topics
from sim.publisher import publish_many
from storage.migrate import latest_version
from tests.support.daemon import DaemonProcess, config_toml, count_rows, http_healthy
from tests.support.mosquitto import Mosquitto
from tests.support.newer_release import migrate_as_newer_release
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1_767_225_600_000
DEVICES = [f"dev-{n:02d}" for n in range(7)]
# Well under the periodic check's 30 s: the migration's NOTIFY is what they hear.
PROMPTLY_S = 15.0


def _messages(first: int, count: int) -> list[tuple[str, bytes]]:
    return [
        (
            TOPICS.telemetry(device),
            msgspec.json.encode(
                msgspec.convert({"ts": T0 + k * 1000, "seq": k, "metrics": {"temp": k}}, Telemetry)
            ),
        )
        for k in range(first, first + count)
        for device in DEVICES
    ]


async def _stored_once(dsn: str) -> tuple[int, int]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) AS n, count(DISTINCT (device_id, ts)) AS distinct_n FROM telemetry"
        )
    finally:
        await conn.close()
    assert row is not None
    return int(row["n"]), int(row["distinct_n"])


async def test_old_nodes_stop_cleanly_when_a_newer_release_migrates_and_lose_nothing(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    ports = [free_port(), free_port()]
    processes = []
    for n, port in enumerate(ports):
        path = tmp_path / f"node-{n}.toml"
        path.write_text(
            config_toml(
                dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}", http_port=port,
                mqtt_extra='shared_group = "upgrade"', ingest_extra="batch_max = 20\nlinger_ms = 0",
                log_level="info",
            )
        )  # fmt: skip
        processes.append(DaemonProcess(path, tmp_path / f"node-{n}.log"))

    async def healthy(n: int) -> None:
        async def check() -> bool:
            assert processes[n].alive(), processes[n].log_tail()
            return await http_healthy(ports[n])

        await wait_until(check, timeout=60, message=f"node-{n} healthy")

    before, during, after = _messages(0, 100), _messages(100, 100), _messages(200, 100)
    try:
        for n, process in enumerate(processes):
            process.start()
            await healthy(n)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=100) as pub:
            await publish_many(pub, before, window=50)

            async def stored_some() -> bool:
                return await count_rows(db_dsn) >= len(before) // 4

            await wait_until(stored_some, timeout=60, message="the nodes store")
            # The first node restarted on the newer release migrates; messages keep coming.
            publishing = asyncio.create_task(publish_many(pub, during, window=10))
            newer = await migrate_as_newer_release(db_dsn)

            async def both_stopped() -> bool:
                return not any(p.alive() for p in processes)

            await wait_until(both_stopped, timeout=PROMPTLY_S, message="the old nodes stopped")
            await publishing
            # With no node of the group running, the broker keeps what comes for the sessions.
            await publish_many(pub, after, window=50)
        for n, process in enumerate(processes):
            log = process.log_text()
            assert process.exit_code() == EXIT_SCHEMA_UPGRADED, (n, log[-3000:])
            lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
            said = [line for line in lines if line["event"] == "schema_upgraded_by_newer_release"]
            assert len(said) == 1, said
            assert said[0]["level"] == "critical", said
            assert said[0]["database_version"] == newer, said
            assert said[0]["known_version"] == latest_version(), said
            assert "install the new release on this node and restart it" in said[0]["action"]
            # Stopped as at SIGTERM: drained, the offline status published.
            assert any(line["event"] == "daemon_stopped" for line in lines), log[-3000:]
        assert await count_rows(db_dsn) < len(before) + len(during) + len(after)

        # The nodes come back on a release that knows the schema (here: this code, the newer
        # release's version row taken away) and take their sessions over.
        conn = await asyncpg.connect(db_dsn)
        try:
            await conn.execute("DELETE FROM schema_migration WHERE version = $1", newer)
        finally:
            await conn.close()
        for n, process in enumerate(processes):
            process.start()
            await healthy(n)
        total = len(before) + len(during) + len(after)

        async def all_stored() -> bool:
            return await count_rows(db_dsn) >= total

        await wait_until(all_stored, timeout=120, message="every message stored")
        for process in processes:
            assert process.terminate() == 0
        assert await _stored_once(db_dsn) == (total, total)
    finally:
        for process in processes:
            process.cleanup()
