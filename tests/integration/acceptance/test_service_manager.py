"""The daemon under a service manager: sd_notify over a real datagram socket, SIGTERM drain."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiomqtt
import asyncpg
import pytest

from protocol import Topics
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream
from tests.support.daemon import DaemonProcess, config_toml, count_rows, http_healthy
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")


class NotifySocket:
    """What systemd listens on: every datagram the daemon sends, with its arrival time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[tuple[float, str]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> NotifySocket:
        self._task = asyncio.create_task(self._receive())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close()

    async def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(self.sock, 4096)
            self.messages.append((time.monotonic(), data.decode()))

    def lines(self) -> list[str]:
        return [line for _, message in self.messages for line in message.split("\n")]

    def count(self, line: str) -> int:
        return self.lines().count(line)

    def last(self, line: str) -> float:
        times = [at for at, message in self.messages if line in message.split("\n")]
        return times[-1] if times else 0.0


@pytest.fixture
async def notify(tmp_path: Path) -> AsyncIterator[NotifySocket]:
    async with NotifySocket(tmp_path / "notify.sock") as sock:
        yield sock


def _process(tmp_path: Path, config: str, notify: NotifySocket, watchdog_s: float) -> DaemonProcess:
    path = tmp_path / "gateway.toml"
    path.write_text(config)
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(int(watchdog_s * 1e6))}
    return DaemonProcess(path, tmp_path / "daemon.log", env=env)


async def test_ready_only_when_it_can_ingest_then_watchdog_reload_and_stopping(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path, notify: NotifySocket
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    await proxy.cut()  # the database is unreachable at first
    http_port = free_port()
    config = config_toml(dsn=through(db_dsn, proxy), mqtt_port=mosquitto.port,
                         http_port=http_port, log_level="info")  # fmt: skip
    process = _process(tmp_path, config, notify, watchdog_s=1.0)
    try:
        process.start()
        await wait_until(lambda: process.log_text().count("database_unavailable") >= 3,
                         timeout=30)  # fmt: skip
        assert notify.count("READY=1") == 0  # not ready while it cannot store anything
        await proxy.resume()
        await wait_until(lambda: notify.count("READY=1") == 1, timeout=60)
        # Ready means ready: the first message right after it is stored.
        assert await http_healthy(http_port)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(TOPICS.telemetry("d1"), b'{"ts": 1, "metrics": {"t": 1}}', qos=1)

        async def stored() -> bool:
            return await count_rows(db_dsn) == 1

        await wait_until(stored, timeout=30)
        await wait_until(lambda: notify.count("WATCHDOG=1") >= 3, timeout=30)
        assert any(line.startswith("STATUS=") for line in notify.lines())

        process.signal(signal.SIGHUP)
        await wait_until(lambda: notify.count("READY=1") == 2, timeout=30)
        lines = notify.lines()
        reloading = lines.index("RELOADING=1")
        assert any(line.startswith("MONOTONIC_USEC=") for line in lines[reloading:])
        assert "READY=1" in lines[reloading:]

        # Off the event loop: the database proxy runs on it and the drain goes through it.
        assert await asyncio.to_thread(process.terminate) == 0
        assert notify.count("STOPPING=1") == 1
    finally:
        await asyncio.to_thread(process.cleanup)
        await proxy.stop()


async def test_a_stuck_database_write_stops_the_watchdog(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path, notify: NotifySocket
) -> None:
    config = config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=free_port())
    process = _process(tmp_path, config, notify, watchdog_s=1.0)
    blocker = await asyncpg.connect(db_dsn)
    try:
        process.start()
        await wait_until(lambda: notify.count("WATCHDOG=1") >= 2, timeout=60)
        await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(TOPICS.telemetry("d1"), b'{"ts": 1, "metrics": {"t": 1}}', qos=1)
        # The write hangs on the lock: after the stall limit (WATCHDOG_USEC) no more pings.
        await wait_until(lambda: time.monotonic() - notify.last("WATCHDOG=1") > 2.5, timeout=30,
                         message="the watchdog pings stopped")  # fmt: skip
        assert "watchdog_withheld" in process.log_text()
        await blocker.execute("ROLLBACK")
        resumed = notify.count("WATCHDOG=1")
        await wait_until(lambda: notify.count("WATCHDOG=1") > resumed, timeout=30)
        assert process.terminate() == 0
    finally:
        await blocker.close()
        process.cleanup()
    assert await count_rows(db_dsn) == 1


async def test_sigterm_during_a_20000_message_stream_loses_nothing(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path, notify: NotifySocket
) -> None:
    http_port = free_port()
    config = config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=http_port,
                         ingest_extra="batch_max = 50\nlinger_ms = 0")  # fmt: skip
    process = _process(tmp_path, config, notify, watchdog_s=10.0)
    stream = list(telemetry_stream(TOPICS, device_ids(100), 20_000))
    try:
        process.start()
        await wait_until(lambda: notify.count("READY=1") == 1, timeout=60)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=500) as pub:
            publisher = asyncio.create_task(publish_many(pub, stream, window=500))

            async def mid_stream() -> bool:
                return await count_rows(db_dsn) >= 3000

            await wait_until(mid_stream, timeout=60)
            process.signal(signal.SIGTERM)
            code = await asyncio.to_thread(process.process.wait, 60)  # type: ignore[union-attr]  # started above
            assert code == 0
            assert notify.count("STOPPING=1") == 1
            at_stop = await count_rows(db_dsn)
            assert at_stop < 20_000, "the stop must land in the middle of the stream"
            await publisher  # the broker keeps what the stopped daemon did not take

        process.start()

        async def all_stored() -> bool:
            return await count_rows(db_dsn) >= 20_000

        await wait_until(all_stored, timeout=120, message="every message stored after restart")
        assert process.terminate() == 0
    finally:
        process.cleanup()
    conn = await asyncpg.connect(db_dsn)
    try:
        assert await conn.fetchval("SELECT count(DISTINCT seq) FROM telemetry") == 20_000
        assert await conn.fetchval("SELECT count(*) FROM telemetry") == 20_000
    finally:
        await conn.close()
