"""Run a gateway daemon inside the test's event loop, or as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import asyncpg

from gateway.config import Config, parse_config
from gateway.runtime.daemon import Daemon

READY_TIMEOUT_S = 60.0


def config_toml(
    *,
    dsn: str,
    mqtt_port: int,
    node_id: str = "test-node",
    protocol: str = "5",
    http_port: int = 0,
    extra: str = "",
    mqtt_extra: str = "",
    ingest_extra: str = "",
    log_level: str = "warning",
    # The tests' samples carry fixed 2026-01-01 timestamps (reproducible event ids): a daemon
    # keeping 30 days would prune them at its first maintenance pass, mid-test.
    retention: str = "telemetry_days = 0",
    # Broker endpoints ([mqtt] hosts, "host:port") instead of 127.0.0.1:mqtt_port.
    mqtt_hosts: list[str] | None = None,
) -> str:
    if mqtt_hosts is None:
        broker = f'host = "127.0.0.1"\nport = {mqtt_port}'
    else:
        broker = "hosts = [" + ", ".join(f'"{h}"' for h in mqtt_hosts) + "]"
    return f"""
[node]
id = "{node_id}"

[mqtt]
{broker}
protocol = "{protocol}"
reconnect_min_s = 0.05
reconnect_max_s = 0.5
{mqtt_extra}

[database]
dsn = "{dsn}"
retry_min_s = 0.05
retry_max_s = 0.5

[ingest]
drain_timeout_s = 20
{ingest_extra}

[http]
port = {http_port}

[log]
format = "json"
level = "{log_level}"

[retention]
{retention}
{extra}
"""


def make_config(**kwargs: object) -> Config:
    return parse_config(config_toml(**kwargs))  # type: ignore[arg-type]  # keyword arguments passed through


@contextlib.asynccontextmanager
async def running_daemon(config: Config) -> AsyncIterator[Daemon]:
    """Start a daemon, wait until it is subscribed, stop it cleanly on exit."""
    daemon = Daemon(config)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop), name=f"daemon-{config.node_id}")
    ready = asyncio.create_task(daemon.ready.wait())
    done, _ = await asyncio.wait(
        {task, ready}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
    )
    if task in done:
        ready.cancel()
        task.result()
        raise AssertionError("daemon exited before it was ready")
    if not done:
        stop.set()
        task.cancel()
        raise AssertionError(f"daemon not ready within {READY_TIMEOUT_S}s")
    try:
        yield daemon
    finally:
        stop.set()
        async with asyncio.timeout(60):
            await task


def session_up(daemon: Daemon) -> bool:
    """The daemon's broker session is connected and subscribed (the node may claim and send)."""
    session = daemon.session
    return session is not None and session.connected and session.subscribed


def session_down(daemon: Daemon) -> bool:
    """The daemon's broker session has noticed its connection is gone."""
    return daemon.session is not None and not daemon.session.connected


def metric(daemon: Daemon, name: str, labels: dict[str, str] | None = None) -> float:
    value = daemon.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def count_rows(dsn: str, table: str = "telemetry") -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(f"SELECT count(*) FROM {table}"))  # noqa: S608 - a table name of the test's own
    finally:
        await conn.close()


async def subscription_proof(dsn: str) -> dict[str, bool]:
    """Each MQTT filter the database remembers, and whether it is recorded proven to deliver
    (``mqtt_subscription.proven_at``, migration 0038)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT topic_filter, proven_at IS NOT NULL FROM mqtt_subscription")
    finally:
        await conn.close()
    return {row[0]: row[1] for row in rows}


class DaemonProcess:
    """``gateway run`` in a child process (for SIGKILL and SIGTERM tests)."""

    def __init__(
        self,
        config_path: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        module: str = "gateway",
    ):
        self.module = module
        self.config_path = config_path
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, "run", "--config", str(self.config_path)],
            stdout=log,
            stderr=log,
            env=self.env,
        )
        log.close()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self, timeout: float = 60) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        """None while it runs."""
        return None if self.process is None else self.process.poll()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cleanup(self) -> None:
        if self.alive():
            self.kill()


async def scrape(port: int) -> dict[str, float]:
    """A daemon's /metrics as series (name with its labels) -> value."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


async def http_healthy(port: int) -> bool:
    """True when the daemon's /health answers 200."""
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/health") as response,
        ):
            return response.status == 200
    except aiohttp.ClientError:
        return False
