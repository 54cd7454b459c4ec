"""Benchmark phases against a running gateway: latency, alarm storm, command round trip.

* latency  — telemetry published at a fixed rate (half the drain rate), each message carrying
             its publish time (``sent_us``); a probe in the benchmark's own database notifies
             at commit, so publish→commit is measured to the commit, on one clock;
* storm    — every device of a fleet crosses a threshold at once: seconds until every alarm
             is committed, and how many there are (one per device is right);
* commands — commands created through the HTTP API to simulated devices answering through
             ``sim.responder``: a burst measures commands/s from creation to ACKED, a run paced
             at half that rate measures the latency of each (database timestamps);
* campaign — one campaign (one HTTP request) to a fleet of simulated devices, no rollout limit:
             commands/s from its creation to the last ACKED, and a check that every command
             ended ACKED exactly once in its generation (one audit row, one accepted receipt).

The first second of each paced run is left out of its percentiles: it measures connection
pools and statement caches warming up, not the steady state.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import aiohttp
import asyncpg
import msgspec

from protocol import MetricValue, Telemetry, Topics, encode_telemetry
from sim.cpu import CpuSplit, CpuWindow, command_parties
from sim.gateways import API_TOKEN, BENCH_TOKEN, RULES, GatewayProcesses
from sim.http_client import LeanHttp
from sim.probes import Probes
from sim.responder import Responder, Script
from sim.sql import blocks
from sim.telemetry import EPOCH_MS, Timeline, device_ids
from sim.wire import WirePublisher

Q: Final = blocks("bench.sql")
WARMUP_S: Final = 1.0
WINDOW: Final = 1000
TICK_S: Final = 0.002
HTTP_CONCURRENCY: Final = 32
STORM_RULE: Final = "temp-high"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0 to 100] of ``values``; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class Percentiles:
    count: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, millis: Sequence[float]) -> Percentiles:
        return cls(
            len(millis),
            percentile(millis, 50),
            percentile(millis, 95),
            percentile(millis, 99),
            max(millis, default=0.0),
        )


@dataclass(frozen=True, slots=True)
class Latency:
    rate: float
    sent: int
    committed: int
    timings: Percentiles


@dataclass(frozen=True, slots=True)
class Storm:
    devices: int
    seconds: float
    publish_seconds: float
    alarms: int
    alarmed_devices: int
    rss_mb: float


@dataclass(frozen=True, slots=True)
class Commands:
    burst: int
    burst_acked: int
    per_s: float
    paced_rate: float
    paced_acked: int
    timings: Percentiles
    burst_cpu: CpuSplit  # over the burst, from its first request to its last ACKED


@dataclass(frozen=True, slots=True)
class CampaignRun:
    devices: int
    acked: int
    seconds: float
    per_s: float
    acked_once: bool  # every command ACKED by exactly one audited write and one receipt
    cpu: CpuSplit  # from the request to the last ACKED


async def paced(
    rate: float, count: int, action: Callable[[int], Coroutine[Any, Any, None]]
) -> None:
    """Start ``action(n)`` for n in 0..count-1 at ``rate`` per second; wait for all of them."""
    started = time.perf_counter()
    n = 0
    async with asyncio.TaskGroup() as tasks:
        while n < count:
            due = min(count, int((time.perf_counter() - started) * rate) + 1)
            while n < due:
                tasks.create_task(action(n))
                n += 1
            await asyncio.sleep(TICK_S)  # the pace itself, not a wait for anything


# -- latency -----------------------------------------------------------------------------------


async def measure_latency(
    port: int,
    dsn: str,
    *,
    rate: float,
    seconds: float,
    devices: int,
    workdir: Path,
    probes: Probes,
    timeline: Timeline | None = None,
) -> Latency:
    """Telemetry at ``rate`` for ``seconds``, one millisecond of device time apart (from its
    stretch of ``timeline``, else the fixed epoch), each stamped with its publish time:
    publish → commit percentiles, the warm-up left out."""
    prefix = "lat"
    topics, ids = Topics(prefix), device_ids(devices, prefix)
    total = max(1, round(rate * seconds))
    epoch_ms = EPOCH_MS if timeline is None else timeline.take(total - 1)
    started_us = time.time_ns() // 1000
    samples: list[float] = []
    committed = 0

    def on_stamps(stamps: list[int], seen_us: int) -> None:
        nonlocal committed
        committed += len(stamps)
        warm = started_us + WARMUP_S * 1e6
        samples.extend((seen_us - sent_us) / 1000 for sent_us in stamps if sent_us >= warm)

    gateways = GatewayProcesses(port=port, dsn=dsn, prefix=prefix, count=1, workdir=workdir)
    node = gateways.nodes[0]
    probes.on_stamps = on_stamps
    try:
        await gateways.start()
        async with WirePublisher("127.0.0.1", port, "bench-latency") as publisher:

            def stamped(first: int, last: int) -> Iterator[tuple[str, bytes]]:
                for n in range(first, last):  # stamped as it goes out, not when it was due
                    metrics: dict[str, MetricValue] = {
                        "temp": 20.0,
                        "sent_us": time.time_ns() // 1000,
                    }
                    message = Telemetry(ts=epoch_ms + n, seq=n, metrics=metrics)
                    yield topics.telemetry(ids[n % len(ids)]), encode_telemetry(message)

            started_us = time.time_ns() // 1000
            started, sent = time.perf_counter(), 0
            while sent < total:
                due = min(total, int((time.perf_counter() - started) * rate) + 1)
                await publisher.publish_all(stamped(sent, due))
                sent = due
                await asyncio.sleep(TICK_S)  # the pace itself, not a wait for anything
        await probes.until(
            lambda: probes.stored[node] >= total, timeout_s=120, what="the latency run's commits"
        )
    finally:
        probes.on_stamps = None
        await gateways.stop()
    return Latency(rate, total, committed, Percentiles.of(samples))


# -- alarm storm -------------------------------------------------------------------------------


# The storm's readings are dated seq 0 and 1 from its first time.
STORM_SPAN_MS = 1


def _readings(
    topics: Topics, ids: Iterable[str], *, seq: int, temp: float, epoch_ms: int
) -> list[tuple[str, bytes]]:
    return [
        (
            topics.telemetry(device),
            encode_telemetry(Telemetry(ts=epoch_ms + seq, seq=seq, metrics={"temp": temp})),
        )
        for device in ids
    ]


async def measure_storm(
    port: int,
    dsn: str,
    *,
    devices: int,
    workdir: Path,
    probes: Probes,
    timeline: Timeline | None = None,
) -> Storm:
    """Every device reports a normal reading, then all cross the threshold at once (dated from
    its stretch of ``timeline``, else the fixed epoch)."""
    epoch_ms = EPOCH_MS if timeline is None else timeline.take(STORM_SPAN_MS)
    prefix = "storm"
    topics, ids = Topics(prefix), device_ids(devices, prefix)
    gateways = GatewayProcesses(port=port, dsn=dsn, prefix=prefix, count=1, workdir=workdir)
    node = gateways.nodes[0]
    conn = await asyncpg.connect(dsn)
    try:
        await gateways.start()
        async with WirePublisher("127.0.0.1", port, "bench-storm") as publisher:
            # Known devices below the threshold first: the storm is a crossing, not first sight.
            await publisher.publish_all(_readings(topics, ids, seq=0, temp=20.0, epoch_ms=epoch_ms))
            await probes.until(
                lambda: probes.stored[node] >= devices,
                timeout_s=300,
                what="the storm's normal readings",
            )
            crossing = _readings(topics, ids, seq=1, temp=95.0, epoch_ms=epoch_ms)
            started = time.perf_counter()
            await publisher.publish_all(crossing)
            published = time.perf_counter()
        finished = await probes.until(
            lambda: probes.alarms[node] >= devices, timeout_s=300, what="the storm's alarms"
        )
        await probes.until(
            lambda: probes.stored[node] >= 2 * devices,
            timeout_s=300,
            what="the storm's readings",
        )
        row = await conn.fetchrow(Q["storm_alarms"], node)
        assert row is not None
        rss = gateways.peak_rss_mb()
    finally:
        await gateways.stop()
        await conn.close()
    return Storm(
        devices,
        finished - started,
        published - started,
        int(row["alarms"]),
        int(row["devices"]),
        rss,
    )


# -- command round trip ------------------------------------------------------------------------


def _finish_times(rows: Sequence[asyncpg.Record]) -> tuple[list[float], float]:
    """Creation→finish milliseconds of ACKED commands, and first creation→last finish (s)."""
    acked = [row for row in rows if row["status"] == "ACKED"]
    millis = [_ms(row["finished_at"] - row["created_at"]) for row in acked]
    if not acked:
        return millis, 0.0
    first: datetime = min(row["created_at"] for row in rows)
    last: datetime = max(row["finished_at"] for row in acked)
    return millis, (last - first).total_seconds()


def _ms(delta: Any) -> float:
    return float(delta.total_seconds() * 1000)


async def measure_commands(
    port: int,
    dsn: str,
    *,
    commands: int,
    devices: int,
    workdir: Path,
    probes: Probes,
    broker_pid: int | None = None,
) -> Commands:
    prefix = "cmd"
    topics = Topics(prefix)
    gateways = GatewayProcesses(
        port=port, dsn=dsn, prefix=prefix, count=1, workdir=workdir, extra=RULES + API_TOKEN
    )
    responder = Responder(
        host="127.0.0.1",
        port=port,
        topics=topics,
        script=Script(seed=1),
        client_id="bench-responder",
        max_pending=WINDOW,
    )
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop), name="bench-responder")
    conn = await asyncpg.connect(dsn)
    try:
        await responder.wait_subscribed()
        await gateways.start()
        headers = {"Authorization": f"Bearer {BENCH_TOKEN}"}
        http = LeanHttp(
            "127.0.0.1", gateways.http_ports[0], headers=headers, limit=HTTP_CONCURRENCY
        )
        try:

            async def run(group: str, rate: float | None) -> list[asyncpg.Record]:
                ids = device_ids(devices, f"{prefix}{group}")

                async def create(n: int) -> None:
                    body = msgspec.json.encode(
                        {"name": "set_interval", "params": {"seconds": 60, "n": n}}
                    )
                    status, answer = await http.post(f"/devices/{ids[n % devices]}/commands", body)
                    if status != 201:
                        raise RuntimeError(f"creating a command: {status} {answer[:500]!r}")

                if rate is None:
                    async with asyncio.TaskGroup() as tasks:
                        for n in range(commands):
                            tasks.create_task(create(n))
                else:
                    await paced(rate, commands, create)
                await probes.until(
                    lambda: probes.finished[f"{prefix}{group}"] >= commands,
                    timeout_s=600,
                    what=f"the {group} commands to finish",
                )
                return list(await conn.fetch(Q["command_timings"], f"{prefix}{group}-%"))

            window = CpuWindow(command_parties(gateways.pids, broker_pid))
            window.start()
            burst_rows = await run("burst", None)
            burst_cpu = window.stop()
            _, burst_s = _finish_times(burst_rows)
            burst_acked = sum(row["status"] == "ACKED" for row in burst_rows)
            per_s = burst_acked / burst_s if burst_s > 0 else 0.0
            paced_rate = max(1.0, per_s / 2)
            paced_rows = await run("paced", paced_rate)
            millis, _ = _finish_times(paced_rows)
            warmup = int(paced_rate * WARMUP_S)
        finally:
            await http.close()
    finally:
        stop.set()
        await answering
        await gateways.stop()
        await conn.close()
    return Commands(
        burst=commands,
        burst_acked=burst_acked,
        per_s=per_s,
        paced_rate=paced_rate,
        paced_acked=len(millis),
        timings=Percentiles.of(millis[warmup:]),
        burst_cpu=burst_cpu,
    )


async def measure_campaign(
    port: int,
    dsn: str,
    *,
    devices: int,
    workdir: Path,
    probes: Probes,
    broker_pid: int | None = None,
) -> CampaignRun:
    """One campaign to ``devices`` simulated devices; first creation to last ACKED."""
    prefix = "camp"
    gateways = GatewayProcesses(
        port=port, dsn=dsn, prefix=prefix, count=1, workdir=workdir, extra=RULES + API_TOKEN
    )
    responder = Responder(
        host="127.0.0.1",
        port=port,
        topics=Topics(prefix),
        script=Script(seed=1),
        client_id="bench-campaign-responder",
        max_pending=WINDOW,
    )
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop), name="bench-campaign-responder")
    conn = await asyncpg.connect(dsn)
    try:
        await responder.wait_subscribed()
        await gateways.start()
        base = f"http://127.0.0.1:{gateways.http_ports[0]}"
        headers = {"Authorization": f"Bearer {BENCH_TOKEN}"}
        body = {
            "name": "set_interval",
            "params": {"seconds": 60},
            "targets": {"devices": device_ids(devices, prefix)},
        }
        window = CpuWindow(command_parties(gateways.pids, broker_pid))
        window.start()
        async with (
            aiohttp.ClientSession(base, headers=headers) as http,
            http.post("/campaigns", json=body) as reply,
        ):
            if reply.status != 201:
                raise RuntimeError(f"creating the campaign: {reply.status} {await reply.text()}")
            campaign_id = (await reply.json())["campaign"]["id"]
        await probes.until(
            lambda: probes.finished[prefix] >= devices,
            timeout_s=600,
            what="the campaign's commands to finish",
        )
        cpu = window.stop()
        rows = list(await conn.fetch(Q["campaign_check"], campaign_id))
    finally:
        stop.set()
        await answering
        await gateways.stop()
        await conn.close()
    _, seconds = _finish_times(rows)
    acked = sum(row["status"] == "ACKED" for row in rows)
    once = len(rows) == devices and all(
        row["status"] == "ACKED" and row["acked_audits"] == 1 and row["acked_receipts"] == 1
        for row in rows
    )
    return CampaignRun(
        devices=devices,
        acked=acked,
        seconds=seconds,
        per_s=acked / seconds if seconds > 0 else 0.0,
        acked_once=once,
        cpu=cpu,
    )
