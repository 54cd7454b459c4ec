"""The daemon as a real process survives its database connections being cut under load."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import aiomqtt
import asyncpg

from protocol import Topics
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream
from tests.support.daemon import DaemonProcess, config_toml, count_rows
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
RATE = 400  # messages per second, the load under which cuts used to kill the daemon
TICK_S = 0.025
CUTS = 10
PROGRESS = 100  # rows stored after a cut before the next one


async def _health(port: int) -> int | None:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/health") as response,
        ):
            return response.status
    except aiohttp.ClientError:
        return None


class SteadyPublisher:
    """QoS 1 telemetry at a steady rate until stopped; counts what the broker acknowledged."""

    def __init__(self, port: int, messages: Iterator[tuple[str, bytes]]) -> None:
        self.port = port
        self.messages = messages
        self.published = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        per_tick = max(1, round(RATE * TICK_S))
        loop = asyncio.get_running_loop()
        async with aiomqtt.Client("127.0.0.1", self.port, max_inflight_messages=500) as pub:
            next_tick = loop.time()
            while not self.stop.is_set():
                chunk = [next(self.messages) for _ in range(per_tick)]
                self.published += await publish_many(pub, chunk, window=per_tick)
                # Pacing of the load generator, not a wait for the gateway.
                next_tick += TICK_S
                await asyncio.sleep(max(0.0, next_tick - loop.time()))


async def _cut_backends(admin: asyncpg.Connection, dsn_database: str) -> int:
    """Terminate every backend on the daemon's database (pool and LISTEN connections)."""
    return int(
        await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            dsn_database,
        )
    )


async def test_backends_cut_under_load_never_kill_the_daemon_and_lose_nothing(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    # A rule that never fires still puts the alarm engine's reads into every transaction.
    rule = (
        '[[rules]]\nkey = "hot"\nkind = "threshold"\nmetric = "temp"\nop = ">"\n'
        'value = 1000\nseverity = "INFO"\n'
    )
    config.write_text(
        config_toml(
            dsn=through(db_dsn, proxy), mqtt_port=mosquitto.port, node_id="cut-node",
            http_port=http_port, ingest_extra="batch_max = 50", log_level="info", extra=rule,
        )
    )  # fmt: skip
    process = DaemonProcess(config, tmp_path / "daemon.log")
    database = urlsplit(db_dsn).path.lstrip("/")  # the embedded DSN ends in ?host=<socket>
    admin = await asyncpg.connect(db_dsn)
    publisher = SteadyPublisher(
        mosquitto.port, iter(telemetry_stream(TOPICS, device_ids(50), 1_000_000))
    )
    publishing: asyncio.Task[None] | None = None

    def alive() -> None:
        assert process.alive(), f"daemon exited:\n{process.log_tail()}"

    async def healthy() -> bool:
        alive()
        return await _health(http_port) == 200

    async def stored_at_least(n: int) -> bool:
        alive()
        return await count_rows(db_dsn) >= n

    try:
        process.start()
        await wait_until(healthy, timeout=60, message="daemon healthy")
        publishing = asyncio.create_task(publisher.run())
        await wait_until(lambda: stored_at_least(PROGRESS), timeout=60)
        terminated = 0
        for _ in range(CUTS):
            terminated += await _cut_backends(admin, database)
            at_cut = await count_rows(db_dsn)
            await wait_until(
                lambda at=at_cut: stored_at_least(at + PROGRESS),  # type: ignore[misc]  # the loop value bound on purpose
                timeout=60, message="ingest resumed after the cut",
            )  # fmt: skip
        assert terminated >= CUTS

        # An outage, not just a cut: /health answers 503 while the database is unreachable
        # and every loop keeps going; then everything comes back by itself.
        await proxy.cut()

        async def unhealthy() -> bool:
            alive()
            return await _health(http_port) == 503

        await wait_until(unhealthy, timeout=30, message="/health 503 during the outage")
        await proxy.resume()
        await wait_until(healthy, timeout=60, message="/health 200 after the outage")
        at_resume = await count_rows(db_dsn)
        await wait_until(lambda: stored_at_least(at_resume + PROGRESS), timeout=60)

        publisher.stop.set()
        await publishing
        published = publisher.published
        await wait_until(
            lambda: stored_at_least(published), timeout=90, message="every message stored"
        )
        alive()
        # Off the event loop: the daemon's database connections go through this loop's proxy.
        assert await asyncio.to_thread(process.terminate) == 0
    finally:
        publisher.stop.set()
        if publishing is not None:
            with contextlib.suppress(Exception):
                await publishing
        process.cleanup()
        await admin.close()
        await proxy.stop()

    conn = await asyncpg.connect(db_dsn)
    try:
        rows, ids, seqs = await conn.fetchrow(
            "SELECT count(*), count(DISTINCT event_id), count(DISTINCT seq) FROM telemetry"
        )
    finally:
        await conn.close()
    assert rows == ids == seqs == published
