"""``gateway-sim bench --phase streams``: ingest with live stream readers next to ingest without.

One gateway process, one broker, one database; a full-speed live publisher sends the hysteresis
stream (every device crosses the alarm threshold and back all along, so the outbox, and with it
every stream, carries alarm events the whole time). First with no stream open, then with
``readers`` clients reading ``GET /stream`` (each reads and counts what comes, as a screen
would), then with none again. The figure is the ingest rate with readers over the mean of the
two runs without: the same process, the same machine, minutes apart, so the ratio holds on a
noisy machine. Each rate runs from the first publish to the last row committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from protocol import Topics
from sim.cpu import process_cpu_s
from sim.gateways import API_TOKEN, BENCH_TOKEN, RULES, GatewayProcesses
from sim.probes import Probes
from sim.telemetry import device_ids, hysteresis_stream
from sim.wire import WirePublisher

PREFIX: Final = "gwstreams"
SHARED_DEVICES: Final = 999
READERS: Final = 200
EVENT_MARK: Final = b"\nevent: "


@dataclass(frozen=True, slots=True)
class Ingest:
    messages: int
    seconds: float
    gateway_cpu_s: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StreamsRun:
    readers: int
    without: Ingest  # before the readers
    with_readers: Ingest
    after: Ingest  # after them: the drift of the machine over the phase
    events_min: int  # events each reader got during its run: fewest, most
    events_max: int
    readers_dropped: int  # streams the gateway ended while the readers read
    readers_cpu_s: float  # this process's CPU while the readers read (publisher included)

    @property
    def ratio(self) -> float:
        baseline = (self.without.rate + self.after.rate) / 2
        return self.with_readers.rate / baseline if baseline > 0 else 0.0


class _Reader:
    """One ``GET /stream`` client on a plain socket: reads everything, counts the events. Not
    aiohttp: its chunk parsing for 200 streams would take the cores the gateway is measured
    on (browsers read on other machines)."""

    def __init__(self) -> None:
        self.events = 0
        self.ended = False
        self.live = asyncio.Event()

    async def run(self, host: str, port: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(
                f"GET /stream HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Authorization: Bearer {BENCH_TOKEN}\r\nAccept: text/event-stream\r\n\r\n".encode()
            )
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"GET /stream answered {head[:200]!r}")
            tail = b""
            while chunk := await reader.read(1 << 16):
                self.live.set()  # the first chunk is the comment: registered
                # A marker cut between two reads is counted once, with the tail kept.
                self.events += (tail + chunk).count(EVENT_MARK)
                tail = chunk[-len(EVENT_MARK) + 1 :]
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.ended = True
            self.live.set()
            writer.close()


async def _publish(port: int, run: str, messages: int, period: int) -> None:
    # Devices named after the run: the same samples again would be duplicates, stored once.
    devices = device_ids(SHARED_DEVICES, f"{PREFIX}{run}")
    stream = hysteresis_stream(Topics(PREFIX), devices, messages, period=period)
    async with WirePublisher("127.0.0.1", port, f"bench-publisher-{PREFIX}-{run}") as publisher:
        await publisher.publish_all(stream)


async def _ingest(
    port: int, gateways: GatewayProcesses, probes: Probes, run: str, *, messages: int, period: int
) -> Ingest:
    node = gateways.nodes[0]
    target = probes.stored[node] + messages
    cpu = gateways.cpu_seconds()
    started = time.perf_counter()
    publisher = asyncio.create_task(_publish(port, run, messages, period))
    last = await probes.until(
        lambda: probes.stored[node] >= target,
        timeout_s=900,
        what=f"{PREFIX} run {run} to store {messages} messages",
    )
    await publisher
    return Ingest(messages, last - started, gateways.cpu_seconds() - cpu)


async def measure_streams(
    port: int,
    dsn: str,
    messages: int,
    *,
    readers: int = READERS,
    workdir: Path,
    probes: Probes,
) -> StreamsRun:
    period = max(2, messages // SHARED_DEVICES // 4)
    gateways = GatewayProcesses(
        port=port,
        dsn=dsn,
        prefix=PREFIX,
        count=1,
        workdir=workdir,
        extra=RULES + API_TOKEN,
        # One bench token opens every stream: both limits above the readers.
        http=f"max_streams = {readers + 10}\nmax_streams_per_token = {readers + 10}\n",
    )
    try:
        await gateways.start()
        without = await _ingest(port, gateways, probes, "a", messages=messages, period=period)
        clients = [_Reader() for _ in range(readers)]
        tasks = [
            asyncio.create_task(reader.run("127.0.0.1", gateways.http_ports[0]))
            for reader in clients
        ]
        try:
            async with asyncio.timeout(60):
                for reader in clients:
                    await reader.live.wait()
            sim_cpu = process_cpu_s(os.getpid())
            with_readers = await _ingest(
                port, gateways, probes, "b", messages=messages, period=period
            )
            sim_cpu = process_cpu_s(os.getpid()) - sim_cpu
            # What became final at the last commit reaches the streams within a pass.
            await asyncio.sleep(2)
            counts = [reader.events for reader in clients]
            dropped = sum(reader.ended for reader in clients)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        after = await _ingest(port, gateways, probes, "c", messages=messages, period=period)
    finally:
        await gateways.stop()
    return StreamsRun(
        readers=readers,
        without=without,
        with_readers=with_readers,
        after=after,
        events_min=min(counts, default=0),
        events_max=max(counts, default=0),
        readers_dropped=dropped,
        readers_cpu_s=sim_cpu,
    )


def streams_fields(run: StreamsRun) -> dict[str, object]:
    return {
        "streams_readers": run.readers,
        "streams_messages": run.with_readers.messages,
        "streams_msgs_per_s_without": round(run.without.rate),
        "streams_msgs_per_s_with": round(run.with_readers.rate),
        "streams_msgs_per_s_after": round(run.after.rate),
        "ratio_streams_vs_none": round(run.ratio, 3),
        "streams_gateway_cpu_s_without": round(run.without.gateway_cpu_s, 2),
        "streams_gateway_cpu_s_with": round(run.with_readers.gateway_cpu_s, 2),
        "streams_events_per_reader_min": run.events_min,
        "streams_events_per_reader_max": run.events_max,
        "streams_readers_dropped": run.readers_dropped,
        "streams_sim_cpu_s_with": round(run.readers_cpu_s, 2),
    }
