"""``gateway-sim bench``: the gateway's drain rate next to what this machine allows.

Every figure comes from the same run on the same broker, so the ratios hold on a noisy
machine. Each consumer drains its own pre-queued QoS 1 backlog (distinct topic prefix, same
size, same broker configuration) from a persistent session:

* bare     — an aiomqtt subscriber acking each message by hand: the ceiling of any
             aiomqtt-based consumer;
* native   — ``mosquitto_sub`` (C): the broker + loopback ceiling;
* gateway  — ``gateway run`` (decode, event id, batched transaction, ack after commit);
* gateway2 — two gateway processes sharing the subscription (``$share``), measured live
             (against a full-speed publisher) next to one process measured the same way;
* naive    — the one-commit-per-message baseline in ``sim.naive``.

Rates run from the first message to the last one of each drain.
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import aiomqtt
import asyncpg
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from protocol import TopicKind, Topics
from sim.broker import BenchBroker, free_port
from sim.naive import naive_drain
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream

RECEIVE_MAXIMUM = 1000
POLL_S = 0.005
DEVICES = 1000


@dataclass(frozen=True, slots=True)
class Drain:
    messages: int
    seconds: float
    rss_mb: float = 0.0

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0


def _subscription(prefix: str) -> str:
    return Topics(prefix).subscription(TopicKind.TELEMETRY)


def _session_properties() -> Properties:
    properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    properties.SessionExpiryInterval = 3600
    properties.ReceiveMaximum = RECEIVE_MAXIMUM
    return properties


def _manual_ack_client(port: int, client_id: str) -> aiomqtt.Client:
    client = aiomqtt.Client(
        "127.0.0.1",
        port,
        identifier=client_id,
        protocol=aiomqtt.ProtocolVersion.V5,
        clean_start=False,
        properties=_session_properties(),
    )
    client._client.manual_ack_set(True)
    return client


async def _backlog(port: int, prefix: str, messages: int) -> None:
    # Devices named after the phase: identical content would share event ids across phases
    # and be (correctly) stored once.
    stream = telemetry_stream(Topics(prefix), device_ids(DEVICES, prefix), messages, seed=7)
    async with aiomqtt.Client("127.0.0.1", port, max_inflight_messages=1000) as publisher:
        await publish_many(publisher, stream, window=1000)


async def measure_bare(port: int, messages: int) -> Drain:
    prefix, client_id = "bare", "bench-bare"
    async with _manual_ack_client(port, client_id) as client:
        await client.subscribe(_subscription(prefix), qos=1)
    await _backlog(port, prefix, messages)
    received = 0
    first = last = 0.0
    async with _manual_ack_client(port, client_id) as client:
        async for message in client.messages:
            client._client.ack(message.mid, message.qos)
            received += 1
            if received == 1:
                first = time.perf_counter()
            elif received == messages:
                last = time.perf_counter()
                break
    return Drain(messages - 1, last - first)


async def measure_native(port: int, messages: int) -> Drain:
    prefix, client_id = "native", "bench-native"
    base = ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-i", client_id, "-c",
            "-q", "1", "-V", "5", "-x", "3600", "-t", _subscription(prefix)]  # fmt: skip
    await _run([*base, "-E"])
    await _backlog(port, prefix, messages)
    started = time.perf_counter()
    await _run([*base, "-C", str(messages)])
    return Drain(messages, time.perf_counter() - started)


async def _run(argv: list[str], timeout_s: float = 600) -> None:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL)
    async with asyncio.timeout(timeout_s):
        if await process.wait() != 0:
            raise RuntimeError(f"{argv[0]} exited with {process.returncode}")


class GatewayProcesses:
    """``gateway run`` processes of one measurement, configs in a temporary directory."""

    def __init__(self, *, port: int, dsn: str, prefix: str, count: int, workdir: Path) -> None:
        self.nodes = [f"bench-{prefix}-{n}" for n in range(count)]
        self.http_ports = [free_port() for _ in range(count)]
        self.configs: list[Path] = []
        for node, http_port in zip(self.nodes, self.http_ports, strict=True):
            path = workdir / f"{node}.toml"
            shared = f'shared_group = "{prefix}"\n' if count > 1 else ""
            path.write_text(
                f'[node]\nid = "{node}"\n'
                f'[mqtt]\nhost = "127.0.0.1"\nport = {port}\ntopic_prefix = "{prefix}"\n'
                f"receive_maximum = {RECEIVE_MAXIMUM}\n{shared}"
                f'[database]\ndsn = "{dsn}"\n'
                f"[http]\nport = {http_port}\n"
                '[log]\nformat = "json"\nlevel = "warning"\n'
            )
            self.configs.append(path)
        self.workdir = workdir
        self.processes: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        for path in self.configs:
            with (self.workdir / f"{path.stem}.log").open("ab") as log:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "gateway", "run", "--config", str(path),
                    stdout=log, stderr=log,
                )  # fmt: skip
            self.processes.append(process)
        async with aiohttp.ClientSession() as http:
            for port in self.http_ports:
                await _wait_healthy(http, port)

    def peak_rss_mb(self) -> float:
        """Largest peak resident set size (VmHWM) among the processes."""
        peaks = []
        for process in self.processes:
            try:
                status = Path(f"/proc/{process.pid}/status").read_text()
            except OSError:
                continue
            peaks += [int(line.split()[1]) / 1024 for line in status.splitlines()
                      if line.startswith("VmHWM:")]  # fmt: skip
        return max(peaks, default=0.0)

    async def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        async with asyncio.timeout(60):
            for process in self.processes:
                if await process.wait() != 0:
                    raise RuntimeError(f"gateway exited with {process.returncode}")
        self.processes.clear()


async def _wait_healthy(http: aiohttp.ClientSession, port: int) -> None:
    async with asyncio.timeout(60):
        while True:
            try:
                async with http.get(f"http://127.0.0.1:{port}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)


async def _count(conn: asyncpg.Connection, nodes: list[str]) -> int:
    query = "SELECT count(*) FROM telemetry WHERE node_id = ANY($1::text[])"
    return int(await conn.fetchval(query, nodes))


async def _time_to_count(
    conn: asyncpg.Connection, nodes: list[str], messages: int, timeout_s: float = 900
) -> float:
    """Seconds from the first stored row to the last, by polling the table."""
    first = 0.0
    async with asyncio.timeout(timeout_s):
        while True:
            count = await _count(conn, nodes)
            now = time.perf_counter()
            if count and not first:
                first = now
            if count >= messages:
                return now - first
            await asyncio.sleep(POLL_S)


async def measure_gateway(
    port: int, dsn: str, messages: int, *, processes: int, live: bool, workdir: Path
) -> Drain:
    """Drain a pre-queued backlog (``live=False``) or keep up with a full-speed publisher.

    mosquitto 2.0 does not queue messages of a shared subscription whose members are all
    offline, so several processes can only be measured live; one process is measured both
    ways so that the two-versus-one ratio compares like with like.
    """
    prefix = f"gw{processes}{'live' if live else 'drain'}"
    gateways = GatewayProcesses(port=port, dsn=dsn, prefix=prefix, count=processes, workdir=workdir)
    conn = await asyncpg.connect(dsn)
    try:
        await gateways.start()
        if live:
            publisher = asyncio.create_task(_backlog(port, prefix, messages))
        else:
            await gateways.stop()  # the first start created the persistent session
            await _backlog(port, prefix, messages)
            await gateways.start()
        seconds = await _time_to_count(conn, gateways.nodes, messages)
        if live:
            await publisher
        rss = gateways.peak_rss_mb()
    finally:
        await conn.close()
        await gateways.stop()
    return Drain(messages, seconds, rss)


async def measure_naive(port: int, dsn: str, messages: int) -> Drain:
    prefix, client_id = "naive", "bench-naive"
    topic = _subscription(prefix)
    async with aiomqtt.Client(
        "127.0.0.1", port, identifier=client_id, protocol=aiomqtt.ProtocolVersion.V311,
        clean_session=False,
    ) as client:  # fmt: skip
        await client.subscribe(topic, qos=1)
    await _backlog(port, prefix, messages)
    conn = await asyncpg.connect(dsn)
    try:
        drain = asyncio.create_task(
            naive_drain(
                host="127.0.0.1", port=port, client_id=client_id, topic=topic, dsn=dsn,
                count=messages, topics=Topics(prefix),
            )
        )  # fmt: skip
        seconds = await _time_to_count(conn, ["naive"], messages)
        await drain
    finally:
        await conn.close()
    return Drain(messages, seconds)


def _with_database(dsn: str, database: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{database}"))


async def run_bench(*, messages: int, naive_messages: int, dsn: str) -> dict[str, Any]:
    database = f"gw_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(dsn)
    await admin.execute(f'CREATE DATABASE "{database}"')
    bench_dsn = _with_database(dsn, database)
    try:
        with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
            workdir = Path(tmp)
            config = workdir / "migrate.toml"
            config.write_text(f'[database]\ndsn = "{bench_dsn}"\n')
            await _run([sys.executable, "-m", "gateway", "migrate", "--config", str(config)])
            with BenchBroker(inflight=RECEIVE_MAXIMUM) as broker:
                port = broker.port
                bare = _progress("bare", await measure_bare(port, messages))
                native = _progress("native", await measure_native(port, messages))
                one = _progress(
                    "gateway",
                    await measure_gateway(
                        port, bench_dsn, messages, processes=1, live=False, workdir=workdir
                    ),
                )
                one_live = _progress(
                    "gateway live",
                    await measure_gateway(
                        port, bench_dsn, messages, processes=1, live=True, workdir=workdir
                    ),
                )
                two_live = _progress(
                    "gateway x2 live",
                    await measure_gateway(
                        port, bench_dsn, messages, processes=2, live=True, workdir=workdir
                    ),
                )
                naive = _progress("naive", await measure_naive(port, bench_dsn, naive_messages))
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()
    return {
        "messages": messages,
        "naive_messages": naive_messages,
        "bare_msgs_per_s": round(bare.rate),
        "native_msgs_per_s": round(native.rate),
        "gateway_msgs_per_s": round(one.rate),
        "gateway_live_msgs_per_s": round(one_live.rate),
        "gateway2_msgs_per_s": round(two_live.rate),
        "naive_msgs_per_s": round(naive.rate),
        "ratio_gateway_vs_bare": round(one.rate / bare.rate, 3),
        "ratio_gateway_vs_naive": round(one.rate / naive.rate, 2),
        "ratio_gateway_vs_native": round(one.rate / native.rate, 3),
        "ratio_two_vs_one": round(two_live.rate / one_live.rate, 3),
        "rss_mb": round(max(one.rss_mb, one_live.rss_mb, two_live.rss_mb), 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
    }


def _progress(name: str, drain: Drain) -> Drain:
    print(
        f"  {name:<11} {drain.rate:>10,.0f} msg/s  ({drain.messages} in {drain.seconds:.2f} s)",
        file=sys.stderr,
        flush=True,
    )
    return drain


def render_table(result: dict[str, Any]) -> str:
    rows = [
        ("bare aiomqtt + manual ack (ceiling)", f"{result['bare_msgs_per_s']:,} msg/s"),
        ("mosquitto_sub (native)", f"{result['native_msgs_per_s']:,} msg/s"),
        ("gateway, 1 process", f"{result['gateway_msgs_per_s']:,} msg/s"),
        ("gateway, 1 process, live publisher", f"{result['gateway_live_msgs_per_s']:,} msg/s"),
        ("gateway, 2 processes ($share), live", f"{result['gateway2_msgs_per_s']:,} msg/s"),
        ("naive: one commit per message", f"{result['naive_msgs_per_s']:,} msg/s"),
        ("gateway / bare", f"{result['ratio_gateway_vs_bare']:.2f}"),
        ("gateway / native", f"{result['ratio_gateway_vs_native']:.2f}"),
        ("gateway / naive", f"{result['ratio_gateway_vs_naive']:.1f}x"),
        ("two processes / one", f"{result['ratio_two_vs_one']:.2f}"),
        ("gateway peak RSS", f"{result['rss_mb']} MB"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"backlog: {result['messages']:,} QoS 1 messages ({result['machine']})"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
