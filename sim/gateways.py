"""``gateway run`` processes the benchmark starts, configures and watches.

The benchmark drives the gateway as its users do — a process with a TOML file, MQTT in, the
HTTP API for commands — so it measures the real thing, and ``sim`` needs none of its code.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from pathlib import Path
from typing import Final

import aiohttp

from sim.cpu import processes_cpu_s
from sim.ports import free_port

RECEIVE_MAXIMUM: Final = 1000
# A fresh operator token per run: the API refuses calls without one.
BENCH_TOKEN: Final = secrets.token_urlsafe(24)

# Rules are on in every measurement: each message is evaluated, as in production. The bench
# data stays below these thresholds except where a phase crosses them on purpose.
RULES: Final = """
[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
severity = "CRITICAL"

[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
"""

API_TOKEN: Final = f"""
[[api.tokens]]
token = "{BENCH_TOKEN}"
role = "operator"
name = "bench"
"""


class GatewayProcesses:
    """``gateway run`` processes of one measurement, configs in a temporary directory.

    ``extra`` is appended to every config (rules, tokens, command settings), ``http`` to its
    ``[http]`` section; with several processes they share the telemetry subscription as group
    ``prefix``.
    """

    def __init__(
        self,
        *,
        port: int,
        dsn: str,
        prefix: str,
        count: int,
        workdir: Path,
        extra: str = RULES,
        protocol: str = "5",
        http: str = "",
    ) -> None:
        self.nodes = [f"bench-{prefix}-{n}" for n in range(count)]
        self.http_ports = [free_port() for _ in range(count)]
        self.configs: list[Path] = []
        for node, http_port in zip(self.nodes, self.http_ports, strict=True):
            path = workdir / f"{node}.toml"
            shared = f'shared_group = "{prefix}"\n' if count > 1 else ""
            path.write_text(
                f'[node]\nid = "{node}"\n'
                f'[mqtt]\nhost = "127.0.0.1"\nport = {port}\ntopic_prefix = "{prefix}"\n'
                f'receive_maximum = {RECEIVE_MAXIMUM}\nprotocol = "{protocol}"\n{shared}'
                # The window BenchBroker gives 3.1.1 clients (max_inflight_messages): with the
                # default 20 a 3.1.1 batch was 10 messages, and the drain measured that.
                f"broker_inflight = {RECEIVE_MAXIMUM}\n"
                f'[database]\ndsn = "{dsn}"\n'
                f"[http]\nport = {http_port}\n{http}"
                '[log]\nformat = "json"\nlevel = "warning"\n'
                # The bench's samples are dated from 2026-01-01 (reproducible): kept whatever
                # today is, not pruned by a maintenance pass mid-measurement.
                "[retention]\ntelemetry_days = 0\n"
                f"{extra}"
            )
            self.configs.append(path)
        self.workdir = workdir
        self.processes: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        for path in self.configs:
            with (self.workdir / f"{path.stem}.log").open("ab") as log:
                process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "gateway",
                    "run",
                    "--config",
                    str(path),
                    stdout=log,
                    stderr=log,
                )
            self.processes.append(process)
        async with aiohttp.ClientSession() as http:
            for port, process in zip(self.http_ports, self.processes, strict=True):
                try:
                    # A gateway that exits (a refused config) fails the phase at once.
                    await wait_healthy(http, port, process=process)
                except RuntimeError as exc:
                    raise RuntimeError(f"{exc}:\n{self.log_tail()}") from exc

    async def counters(self, *names: str) -> dict[str, float]:
        """The sum over the running processes of each counter in ``names`` (as /metrics
        exposes it: ``gateway_ingest_statements_total``)."""
        sums = dict.fromkeys(names, 0.0)
        async with aiohttp.ClientSession() as http:
            for port in self.http_ports:
                async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                    text = await response.text()
                for line in text.splitlines():
                    name, _, value = line.partition(" ")
                    if name in sums:
                        sums[name] += float(value)
        return sums

    def peak_rss_mb(self) -> float:
        """Largest peak resident set size (VmHWM) among the processes."""
        peaks = []
        for process in self.processes:
            try:
                status = Path(f"/proc/{process.pid}/status").read_text()
            except OSError:
                continue
            peaks += [
                int(line.split()[1]) / 1024
                for line in status.splitlines()
                if line.startswith("VmHWM:")
            ]
        return max(peaks, default=0.0)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the running processes have used so far, together."""
        return processes_cpu_s(self.pids())

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def log_tail(self, lines: int = 20) -> str:
        tails = []
        for path in self.configs:
            log = self.workdir / f"{path.stem}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            tails.append("\n".join(text.splitlines()[-lines:]))
        return "\n".join(tails)

    async def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        async with asyncio.timeout(60):
            for process in self.processes:
                if await process.wait() != 0:
                    raise RuntimeError(
                        f"gateway exited with {process.returncode}:\n{self.log_tail()}"
                    )
        self.processes.clear()


# A gateway is healthy once subscribed. Restarted onto a queued backlog, its session's messages
# come before the SUBACK (mosquitto sends them first): an MQTT 3.1.1 gateway draining 100,000
# at 1,300 msg/s on a slow hour is 80 s from healthy, and that drain is what is measured.
HEALTHY_TIMEOUT_S: Final = 600.0


async def wait_healthy(
    http: aiohttp.ClientSession,
    port: int,
    timeout_s: float = HEALTHY_TIMEOUT_S,
    *,
    process: asyncio.subprocess.Process | None = None,
) -> None:
    """Until the gateway on ``port`` answers /health 200; raises at once if ``process`` (the
    gateway itself, when given) exited meanwhile."""
    async with asyncio.timeout(timeout_s):
        while True:
            if process is not None and process.returncode is not None:
                raise RuntimeError(f"gateway on port {port} exited with {process.returncode}")
            try:
                async with http.get(f"http://127.0.0.1:{port}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
