"""``gateway-sim bench``: the gateway's drain rate next to what this machine allows.

Every figure comes from the same run on the same broker, so the ratios hold on a noisy
machine. Each consumer drains its own pre-queued QoS 1 backlog (distinct topic prefix, same
size, same broker configuration) from a persistent session:

* bare     — an aiomqtt subscriber acking each message by hand: the ceiling of any
             aiomqtt-based consumer;
* native   — ``mosquitto_sub`` (C): the broker + loopback ceiling;
* reference — the minimal exactly-once consumer in ``sim.reference`` (``mqtt5`` codec,
             batched insert, ack after commit, nothing else): what the gateway aims at;
* gateway  — ``gateway run`` with rules on (decode, event id, rules, batched transaction, ack
             after commit), over MQTT 5 and over MQTT 3.1.1, with its CPU time per message;
* gateway2 — two gateway processes sharing the subscription (``$share``), measured live
             (against a full-speed publisher) next to one process measured the same way, on
             999 shared devices crossing a threshold all along (alarms checked);
* naive    — the one-commit-per-message baseline in ``sim.naive``.

Rates run from the first message to the last one of each drain. CPU per message: the
gateway process's user + system time (``/proc/PID/stat``) from the end of its start-up to the
last commit, divided by the messages; the reference's is the bench process's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import aiomqtt
import asyncpg
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from protocol import TopicKind, Topics
from sim.bench_live import measure_campaign, measure_commands, measure_latency, measure_storm
from sim.bench_streams import measure_streams, streams_fields
from sim.broker import BenchBroker
from sim.cpu import PARTIES, POSTGRES_PIDS_SQL, CpuSplit, PostgresCpu
from sim.gateways import RECEIVE_MAXIMUM, RULES, GatewayProcesses
from sim.naive import naive_drain
from sim.probes import Probes
from sim.reference import reference_drain, reference_subscribe
from sim.sparkplug import sparkplug_stream
from sim.sql import blocks
from sim.telemetry import (
    EPOCH_MS,
    Timeline,
    device_ids,
    hysteresis_alarms,
    hysteresis_span_ms,
    hysteresis_stream,
    telemetry_stream,
)
from sim.vendor import span_ms, vendor_stream
from sim.wire import WirePublisher

DEVICES = 1000
# Prime to 2 and 3: two or three processes sharing the subscription each get every second or
# third message, so each of these devices has its samples judged by every one of them (with
# 1,000 a device would go to one process of two only, with 999 to one of three).
SHARED_DEVICES = 1001
Q = blocks("bench.sql")


@dataclass(frozen=True, slots=True)
class Drain:
    messages: int
    seconds: float
    rss_mb: float = 0.0
    cpu_s: float = 0.0  # CPU time of the consumer's process(es) spent on these messages
    # How many messages cpu_s covers, where not all of them (a drain's CPU is read from its
    # first commit: see measure_gateway).
    cpu_messages: int | None = None
    # PostgreSQL's (sim.cpu.PostgresCpu), live only: the bench database's backends, and the
    # server's own processes (shared with any other database of that server).
    pg_cpu_s: float | None = None
    pg_server_cpu_s: float | None = None
    # The gateways' ingest transactions and the statements they sent (round trips, BEGIN and
    # COMMIT included), over the measurement: gateway_ingest_transactions/_statements.
    transactions: float | None = None
    statements: float | None = None

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_msg(self) -> float:
        covered = self.messages if self.cpu_messages is None else self.cpu_messages
        return self.cpu_s / covered * 1e6 if covered else 0.0

    @property
    def statements_per_batch(self) -> float | None:
        if not self.transactions or self.statements is None:
            return None
        return self.statements / self.transactions

    @property
    def messages_per_batch(self) -> float | None:
        return self.messages / self.transactions if self.transactions else None

    @property
    def pg_cpu_us_per_msg(self) -> float | None:
        if self.pg_cpu_s is None or not self.messages:
            return None
        return self.pg_cpu_s / self.messages * 1e6

    @property
    def pg_server_cpu_us_per_msg(self) -> float | None:
        if self.pg_server_cpu_s is None or not self.messages:
            return None
        return self.pg_server_cpu_s / self.messages * 1e6


def _subscription(prefix: str) -> str:
    return Topics(prefix).subscription(TopicKind.TELEMETRY)


def _session_properties() -> Properties:
    properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]  # paho is untyped
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


def backlog_span_ms(messages: int, *, period: int | None = None, fmt: str = "native") -> int:
    """How long after its first time the last sample of `_backlog`'s stream is dated: what a
    phase takes of the run's `Timeline`."""
    if period is not None:
        return hysteresis_span_ms(SHARED_DEVICES, messages)
    return span_ms(fmt, DEVICES, messages)


async def _backlog(
    port: int,
    prefix: str,
    messages: int,
    period: int | None = None,
    fmt: str = "native",
    *,
    epoch_ms: int = EPOCH_MS,
) -> None:
    # Devices named after the phase: identical content would share event ids across phases
    # and be (correctly) stored once. Dated from epoch_ms: a phase of a full run has its own
    # stretch of the run's Timeline (after the earlier phases'), one alone the fixed epoch.
    stream: Iterator[tuple[str, bytes]]
    if fmt == "sparkplug":
        # Sparkplug B edge nodes in a group of the phase's name (see _mapping): births first,
        # then DDATA by alias; every message stores one sample.
        stream = sparkplug_stream(
            device_ids(DEVICES, prefix), messages, group=prefix, seed=7, epoch_ms=epoch_ms
        )
    elif fmt != "native":
        # A vendor's JSON on its own topics, under the phase's vendor root (see _mapping).
        vendor = vendor_stream(
            fmt, device_ids(DEVICES, prefix), messages, seed=7, epoch_ms=epoch_ms
        )
        root = _vendor_root(prefix)
        stream = ((f"{root}/{topic}", payload) for topic, payload in vendor)
    elif period is None:
        stream = telemetry_stream(
            Topics(prefix), device_ids(DEVICES, prefix), messages, seed=7, epoch_ms=epoch_ms
        )
    else:
        devices = device_ids(SHARED_DEVICES, prefix)
        stream = hysteresis_stream(
            Topics(prefix), devices, messages, period=period, epoch_ms=epoch_ms
        )
    async with WirePublisher("127.0.0.1", port, f"bench-publisher-{prefix}") as publisher:
        await publisher.publish_all(stream)


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
    base = [
        "mosquitto_sub",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-i",
        client_id,
        "-c",
        "-q",
        "1",
        "-V",
        "5",
        "-x",
        "3600",
        "-t",
        _subscription(prefix),
    ]
    await _run([*base, "-E"])
    await _backlog(port, prefix, messages)
    started = time.perf_counter()
    await _run([*base, "-C", str(messages)])
    return Drain(messages, time.perf_counter() - started)


# Vendor profiles drained besides Tasmota (phase 3d), each through its own profile.
OTHER_VENDOR_FORMATS: Final = ("zigbee2mqtt", "shelly-gen2", "chirpstack-v4")


def _key(fmt: str) -> str:
    """A format's name in the report's keys: ``shelly-gen2`` → ``shelly_gen2``."""
    return fmt.replace("-", "_")


def _vendor_root(prefix: str) -> str:
    """The first topic level of a vendor phase's topics: the phase's own (phases never read
    each other's), and not the gateway's ``[mqtt] topic_prefix``, which a mapping may not
    overlap (``{prefix}/{device}/events/rpc`` would match ``{prefix}/events/+/+``)."""
    return f"{prefix}-vendor"


def _mapping(prefix: str, fmt: str) -> str:
    """The [[ingest.mappings]] table of a vendor-format phase: the profile of that name, its
    telemetry topic under the phase's vendor root; for Sparkplug, the [sparkplug] section
    consuming the group of the phase's name."""
    if fmt == "native":
        return ""
    if fmt == "sparkplug":
        return f'[sparkplug]\nenabled = true\nhost_id = "{prefix}"\ngroups = ["{prefix}"]\n'
    topic = {
        "tasmota": "tele/{device}/SENSOR",
        "zigbee2mqtt": "zigbee2mqtt/{device}",
        "shelly-gen2": "{device}/events/rpc",
        "chirpstack-v4": "application/{application_id}/device/{dev_eui}/event/up",
    }[fmt]
    return (
        f'[[ingest.mappings]]\nname = "bench"\nprofile = "{fmt}"\n'
        f'topic = "{_vendor_root(prefix)}/{topic}"\npresence_topic = ""\ncommand_topic = ""\n'
    )


async def _run(argv: list[str], timeout_s: float = 600) -> None:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL)
    async with asyncio.timeout(timeout_s):
        if await process.wait() != 0:
            raise RuntimeError(f"{argv[0]} exited with {process.returncode}")


async def measure_gateway(
    port: int,
    dsn: str,
    messages: int,
    *,
    processes: int,
    live: bool,
    workdir: Path,
    probes: Probes,
    period: int | None = None,
    protocol: str = "5",
    fmt: str = "native",
    rules: bool = True,
    epoch_ms: int = EPOCH_MS,
) -> Drain:
    """Drain a pre-queued backlog (``live=False``) or keep up with a full-speed publisher.

    With ``period``, the live publisher sends the hysteresis stream to the shared devices
    (alarms raised and cleared all along; see ``check_alarms``).

    mosquitto 2.0 does not queue messages of a shared subscription whose members are all
    offline, so several processes can only be measured live; one process is measured both
    ways so that the two-versus-one ratio compares like with like. The time runs from the
    commit of the first rows to the commit of the last.

    ``rules=False`` runs the gateways with no rules configured: the same ingest (MQTT,
    decoding, event ids, telemetry, devices, the breaker's journal, PUBACKs) without
    evaluation and rule state, so that what the rules cost per message can be told apart.
    """
    version = "" if protocol == "5" else protocol.replace(".", "")
    mapped = "" if fmt == "native" else fmt.replace("-", "")
    bare = "" if rules else "norules"
    prefix = f"gw{processes}{'live' if live else 'drain'}{version}{mapped}{bare}"
    gateways = GatewayProcesses(
        port=port,
        dsn=dsn,
        prefix=prefix,
        count=processes,
        workdir=workdir,
        protocol=protocol,
        extra=(RULES if rules else "") + _mapping(prefix, fmt),
    )
    nodes = gateways.nodes
    conn = await asyncpg.connect(dsn)
    postgres = PostgresCpu()
    first_commit: asyncio.Task[tuple[float, int]] | None = None
    try:
        await gateways.start()
        # CPU spent before the messages: starting up (imports, connections, subscriptions).
        # Live, the messages come after it. A drain restarts its gateways onto the backlog
        # and counts from its first commit instead (below).
        startup_cpu = gateways.cpu_seconds()
        # A drain counts from the restart (a new process); live, from here.
        before = dict.fromkeys(_ROUND_TRIPS, 0.0)
        if live:
            before = await gateways.counters(*_ROUND_TRIPS)
        if live:  # PostgreSQL's share is measured live only: a drain restarts its gateway
            postgres.start(await _postgres_pids(conn))
        if live:
            publisher = asyncio.create_task(
                _backlog(port, prefix, messages, period, epoch_ms=epoch_ms)
            )
        else:
            await gateways.stop()  # the first start created the persistent session
            await _backlog(port, prefix, messages, fmt=fmt, epoch_ms=epoch_ms)
            first_commit = asyncio.create_task(_at_first_commit(probes, nodes, gateways))
            await gateways.start()
        last = await probes.until(
            lambda: sum(probes.stored[node] for node in nodes) >= messages,
            timeout_s=900,
            what=f"{prefix} to store {messages} messages",
        )
        cpu = gateways.cpu_seconds() - startup_cpu
        cpu_messages = None
        if first_commit is not None:
            # A drain's CPU runs from its first commit to its last, over the messages
            # committed in between: start-up (the HTTP API, the database, then the broker:
            # gateway.runtime.daemon) is over by the first commit. Subtracting the first
            # start's CPU instead left the second start's own variance in the figure, larger
            # than a small drain's whole cost (a quick run measured -3.0 µs with no rules).
            at_first, stored_first = await first_commit
            cpu, cpu_messages = gateways.cpu_seconds() - at_first, messages - stored_first
        after = await gateways.counters(*_ROUND_TRIPS)
        pg_cpu = postgres.stop(await _postgres_pids(conn)) if live else {}
        first = min(probes.first_stored[node] for node in nodes if node in probes.first_stored)
        if live:
            await publisher
        rss = gateways.peak_rss_mb()
    finally:
        if first_commit is not None and not first_commit.done():
            first_commit.cancel()  # the phase failed before its first commit
        await gateways.stop()
        await conn.close()
    transactions, statements = (after[name] - before[name] for name in _ROUND_TRIPS)
    return Drain(
        messages,
        last - first,
        rss,
        cpu,
        cpu_messages,
        pg_cpu.get("backends"),
        pg_cpu.get("server"),
        transactions,
        statements,
    )


async def _at_first_commit(
    probes: Probes, nodes: Sequence[str], gateways: GatewayProcesses
) -> tuple[float, int]:
    """The gateways' CPU seconds and the messages committed, read together as soon as the
    first of their commits is reported."""
    await probes.until(
        lambda: any(probes.stored[node] for node in nodes),
        timeout_s=900,
        what="the first commit",
    )
    return gateways.cpu_seconds(), sum(probes.stored[node] for node in nodes)


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


# The ingest writer's counters of transactions and of the statements they sent.
_ROUND_TRIPS: Final = ("gateway_ingest_transactions_total", "gateway_ingest_statements_total")


async def _postgres_pids(conn: asyncpg.Connection) -> dict[str, list[int]]:
    parts: dict[str, list[int]] = {"backends": [], "server": []}
    for row in await conn.fetch(POSTGRES_PIDS_SQL):
        parts[row["part"]].append(row["pid"])
    return parts


@dataclass(frozen=True, slots=True)
class AlarmCheck:
    """The alarms a phase on the shared devices raised, against one node's decision."""

    expected: int
    found: int
    cleared_expected: int
    cleared_found: int
    devices_on_several_nodes: int

    @property
    def matches(self) -> bool:
        return (self.expected, self.cleared_expected) == (self.found, self.cleared_found)


async def check_alarms(dsn: str, prefix: str, messages: int, period: int) -> AlarmCheck:
    expected, cleared = hysteresis_alarms(SHARED_DEVICES, messages, period=period)
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(Q["phase_alarms"], f"{prefix}-%")
    finally:
        await conn.close()
    assert row is not None
    return AlarmCheck(
        expected, row["alarms"], cleared, row["cleared"], row["devices_on_several_nodes"]
    )


async def measure_reference(
    port: int, dsn: str, messages: int, *, epoch_ms: int = EPOCH_MS
) -> Drain:
    """The minimal exactly-once consumer (``sim.reference``) on the same kind of backlog."""
    prefix, client_id = "reference", "bench-reference"
    topics = Topics(prefix)
    await reference_subscribe(
        host="127.0.0.1",
        port=port,
        client_id=client_id,
        topic=_subscription(prefix),
        receive_max=RECEIVE_MAXIMUM,
    )
    await _backlog(port, prefix, messages, epoch_ms=epoch_ms)
    cpu = time.process_time()
    seconds = await reference_drain(
        host="127.0.0.1",
        port=port,
        client_id=client_id,
        dsn=dsn,
        count=messages,
        topics=topics,
        receive_max=RECEIVE_MAXIMUM,
    )
    return Drain(messages, seconds, cpu_s=time.process_time() - cpu)


async def measure_naive(port: int, dsn: str, messages: int, *, epoch_ms: int = EPOCH_MS) -> Drain:
    prefix, client_id = "naive", "bench-naive"
    topic = _subscription(prefix)
    async with aiomqtt.Client(
        "127.0.0.1",
        port,
        identifier=client_id,
        protocol=aiomqtt.ProtocolVersion.V311,
        clean_session=False,
    ) as client:
        await client.subscribe(topic, qos=1)
    await _backlog(port, prefix, messages, epoch_ms=epoch_ms)
    seconds = await naive_drain(
        host="127.0.0.1",
        port=port,
        client_id=client_id,
        topic=topic,
        dsn=dsn,
        count=messages,
        topics=Topics(prefix),
    )
    return Drain(messages, seconds)


@contextlib.asynccontextmanager
async def embedded_database(workdir: Path) -> AsyncIterator[str]:
    """The gateway's own embedded PostgreSQL (``gateway embedded-db``) in ``workdir``: its DSN."""
    config = workdir / "embedded-db.toml"
    config.write_text(f'[node]\nstate_dir = "{workdir / "state"}"\n[log]\nlevel = "warning"\n')
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "embedded-db",
        "--config",
        str(config),
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        async with asyncio.timeout(120):
            line = await process.stdout.readline()
        if not line:
            raise RuntimeError(f"gateway embedded-db exited with {await process.wait()}")
        yield line.decode().strip()
    finally:
        if process.returncode is None:
            process.terminate()
        async with asyncio.timeout(60):
            await process.wait()


def _with_database(dsn: str, database: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{database}"))


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much each phase does; ``quick()`` for the CI smoke, the defaults for a full run."""

    messages: int = 100_000
    naive_messages: int = 20_000
    latency_s: float = 20.0
    storm_devices: int = 10_000
    commands: int = 10_000
    command_devices: int = 1_000
    campaign_devices: int = 10_000

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            messages=10_000,
            naive_messages=2_000,
            latency_s=4.0,
            storm_devices=2_000,
            commands=1_000,
            command_devices=100,
            campaign_devices=1_000,
        )


async def run_bench(sizes: Sizes, *, dsn: str | None) -> dict[str, Any]:
    """Every phase; without ``dsn``, on the gateway's embedded PostgreSQL."""
    if dsn is not None:
        return await _run_phases(sizes, dsn=dsn)
    with tempfile.TemporaryDirectory(prefix="gw-bench-db-") as tmp:
        async with embedded_database(Path(tmp)) as embedded:
            return await _run_phases(sizes, dsn=embedded)


async def run_streams_bench(messages: int, readers: int, *, dsn: str | None) -> dict[str, Any]:
    """The streams phase alone (``--phase streams``): its own database, broker and gateway."""
    if dsn is not None:
        return await _run_streams(messages, readers, dsn=dsn)
    with tempfile.TemporaryDirectory(prefix="gw-bench-db-") as tmp:
        async with embedded_database(Path(tmp)) as embedded:
            return await _run_streams(messages, readers, dsn=embedded)


async def _run_streams(messages: int, readers: int, *, dsn: str) -> dict[str, Any]:
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
                async with Probes(bench_dsn) as probes:
                    run = await measure_streams(
                        broker.port,
                        bench_dsn,
                        messages,
                        readers=readers,
                        workdir=workdir,
                        probes=probes,
                    )
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()
    return {
        **streams_fields(run),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
    }


def render_streams_table(result: dict[str, Any]) -> str:
    r = result
    rows = [
        ("stream readers", f"{r['streams_readers']:,}", ""),
        ("messages per run (live publisher)", f"{r['streams_messages']:,}", ""),
        ("ingest, no stream open", f"{r['streams_msgs_per_s_without']:,} msg/s", ""),
        ("ingest, readers reading", f"{r['streams_msgs_per_s_with']:,} msg/s", ""),
        ("ingest, no stream open again", f"{r['streams_msgs_per_s_after']:,} msg/s", ""),
        (
            "with readers / without (mean of both)",
            f"{r['ratio_streams_vs_none']:.2f}",
            "ratio_streams_vs_none",
        ),
        (
            "gateway CPU: without / with readers",
            f"{r['streams_gateway_cpu_s_without']:.1f} / {r['streams_gateway_cpu_s_with']:.1f} s",
            "",
        ),
        (
            "events each reader got: fewest / most",
            f"{r['streams_events_per_reader_min']:,} / {r['streams_events_per_reader_max']:,}",
            "",
        ),
        ("readers the gateway dropped", f"{r['streams_readers_dropped']:,}", ""),
        (
            "simulator CPU with readers (publisher too)",
            f"{r['streams_sim_cpu_s_with']:.1f} s",
            "",
        ),
    ]
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    lines = [f"streams phase ({r['machine']})"]
    for name, value, key in rows:
        line = f"{name:<{width}}  {value:>{value_width}}"
        if key:
            op, bound = STREAMS_TARGETS[key]
            met = float(r[key]) >= bound
            line += f"  target {op} {bound:g}: {'ok' if met else 'MISSED'}"
        lines.append(line)
    return "\n".join(lines)


async def settle(dsn: str) -> None:
    """Vacuum and analyze the filled tables, checkpoint: before the next phase, not in it."""
    conn = await asyncpg.connect(dsn)
    try:
        for row in await conn.fetch(Q["filled_tables"]):
            # VACUUM takes no parameters and runs outside transactions: an identifier it is.
            await conn.execute(f'VACUUM (ANALYZE) "{row["relname"]}"')
        with contextlib.suppress(asyncpg.InsufficientPrivilegeError):  # superusers only
            await conn.execute(Q["checkpoint"])
    finally:
        await conn.close()


async def _run_phases(sizes: Sizes, *, dsn: str) -> dict[str, Any]:  # noqa: PLR0915 - the phases, one after another
    messages = sizes.messages
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

                # Each phase that stores telemetry dates it after every earlier phase's.
                timeline = Timeline()
                bare = _progress("bare", await measure_bare(port, messages))
                native = _progress("native", await measure_native(port, messages))
                # Before the probes: their trigger would cost the baseline a notification
                # per message; it times itself, from its first message to its last commit.
                naive = _progress(
                    "naive",
                    await measure_naive(
                        port,
                        bench_dsn,
                        sizes.naive_messages,
                        epoch_ms=timeline.take(backlog_span_ms(sizes.naive_messages)),
                    ),
                )
                async with Probes(bench_dsn) as probes:
                    # Every measured phase starts settled, as the docs say: the earlier
                    # phases' autovacuum and checkpoint are not left to land in it (until
                    # 2026-12-04 only the phases from the latency on were settled, so the
                    # drains after the reference's paid for what the earlier ones wrote).
                    await settle(bench_dsn)
                    # Under the probes, as every gateway phase is: their trigger costs each
                    # insert statement of ~500 rows what it costs the gateway's (without it
                    # the reference drained 6-9 % faster, docs/performance.md). It still
                    # times itself.
                    reference = _progress(
                        "reference",
                        await measure_reference(
                            port,
                            bench_dsn,
                            messages,
                            epoch_ms=timeline.take(backlog_span_ms(messages)),
                        ),
                    )
                    # The live phases cross the threshold all along, on shared devices: about
                    # two runs of 95 and two of 70 per device, whatever the size.
                    period = max(2, messages // SHARED_DEVICES // 4)

                    async def gateway(processes: int, *, live: bool) -> Drain:
                        await settle(bench_dsn)
                        return await measure_gateway(
                            port,
                            bench_dsn,
                            messages,
                            processes=processes,
                            live=live,
                            workdir=workdir,
                            probes=probes,
                            period=period if live else None,
                            epoch_ms=timeline.take(
                                backlog_span_ms(messages, period=period if live else None)
                            ),
                        )

                    one = _progress("gateway", await gateway(1, live=False))

                    async def drain(
                        fmt: str = "native", protocol: str = "5", *, rules: bool = True
                    ) -> Drain:
                        await settle(bench_dsn)
                        return await measure_gateway(
                            port,
                            bench_dsn,
                            messages,
                            processes=1,
                            live=False,
                            workdir=workdir,
                            probes=probes,
                            protocol=protocol,
                            fmt=fmt,
                            rules=rules,
                            epoch_ms=timeline.take(backlog_span_ms(messages, fmt=fmt)),
                        )

                    one311 = _progress("gateway 3.1.1", await drain(protocol="3.1.1"))
                    # The MQTT 5 drain with no rules configured: the ingest alone, so that
                    # the CPU the rules cost per message (evaluation, the rule state locked
                    # and written back) is measured, not estimated.
                    norules = _progress("gateway, no rules", await drain(rules=False))
                    # The same drain, the messages in Tasmota's JSON on Tasmota's topics,
                    # read by the profile (issue 25): what a mapping costs per message.
                    tasmota = _progress("gateway tasmota", await drain("tasmota"))
                    # The same drain from Sparkplug B edge nodes (protobuf, births then data
                    # by alias, the host's state in PostgreSQL): what Sparkplug costs.
                    spb = _progress("gateway sparkplug", await drain("sparkplug"))
                    # The other vendor profiles' drains: their JSON on their own topics, read
                    # by the same mapping code as Tasmota's (issue 25: each format measured).
                    vendors = {
                        fmt: _progress(f"gateway {fmt}", await drain(fmt))
                        for fmt in OTHER_VENDOR_FORMATS
                    }
                    one_live = _progress("gateway live", await gateway(1, live=True))
                    one_alarms = await check_alarms(bench_dsn, "gw1live", messages, period)
                    two_live = _progress("gateway x2 live", await gateway(2, live=True))
                    two_alarms = await check_alarms(bench_dsn, "gw2live", messages, period)
                    _note(
                        f"alarms, 2 processes: {two_alarms.found:,} of {two_alarms.expected:,}"
                        f" raised, {two_alarms.cleared_found:,} of"
                        f" {two_alarms.cleared_expected:,} cleared;"
                        f" {two_alarms.devices_on_several_nodes} devices on both"
                    )
                    three_live = _progress("gateway x3 live", await gateway(3, live=True))
                    three_alarms = await check_alarms(bench_dsn, "gw3live", messages, period)
                    _note(
                        f"alarms, 3 processes: {three_alarms.found:,} of"
                        f" {three_alarms.expected:,} raised, {three_alarms.cleared_found:,} of"
                        f" {three_alarms.cleared_expected:,} cleared;"
                        f" {three_alarms.devices_on_several_nodes} devices on several"
                    )
                    await settle(bench_dsn)
                    latency = await measure_latency(
                        port,
                        bench_dsn,
                        rate=one.rate / 2,
                        seconds=sizes.latency_s,
                        devices=DEVICES,
                        workdir=workdir,
                        probes=probes,
                        timeline=timeline,
                    )
                    _note(
                        f"latency at {latency.rate:,.0f} msg/s: p99 {latency.timings.p99_ms:.1f} ms"
                    )
                    await settle(bench_dsn)
                    storm = await measure_storm(
                        port,
                        bench_dsn,
                        devices=sizes.storm_devices,
                        workdir=workdir,
                        probes=probes,
                        timeline=timeline,
                    )
                    _note(f"storm: {storm.alarms} alarms in {storm.seconds:.2f} s")
                    await settle(bench_dsn)
                    commands = await measure_commands(
                        port,
                        bench_dsn,
                        commands=sizes.commands,
                        devices=sizes.command_devices,
                        workdir=workdir,
                        probes=probes,
                        broker_pid=broker.pid,
                    )
                    _note(
                        f"commands: {commands.per_s:,.0f}/s, p99 {commands.timings.p99_ms:.1f} ms"
                    )
                    await settle(bench_dsn)
                    campaign = await measure_campaign(
                        port,
                        bench_dsn,
                        devices=sizes.campaign_devices,
                        workdir=workdir,
                        probes=probes,
                        broker_pid=broker.pid,
                    )
                    _note(
                        f"campaign: {campaign.per_s:,.0f}/s ({campaign.acked:,} ACKED,"
                        f" once each: {campaign.acked_once})"
                    )
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()
    return {
        "messages": messages,
        "naive_messages": sizes.naive_messages,
        "bare_msgs_per_s": round(bare.rate),
        "native_msgs_per_s": round(native.rate),
        "gateway_msgs_per_s": round(one.rate),
        "gateway_live_msgs_per_s": round(one_live.rate),
        "gateway2_msgs_per_s": round(two_live.rate),
        "gateway3_msgs_per_s": round(three_live.rate),
        "naive_msgs_per_s": round(naive.rate),
        "reference_msgs_per_s": round(reference.rate),
        "reference_cpu_us_per_msg": round(reference.cpu_us_per_msg, 1),
        "gateway_msgs_per_s_mqtt5": round(one.rate),
        "gateway_msgs_per_s_mqtt311": round(one311.rate),
        "ratio_gateway_vs_reference_mqtt5": round(one.rate / reference.rate, 3),
        "ratio_gateway_vs_reference_mqtt311": round(one311.rate / reference.rate, 3),
        "ratio_gateway_vs_bare_mqtt5": round(one.rate / bare.rate, 3),
        "ratio_gateway_vs_bare_mqtt311": round(one311.rate / bare.rate, 3),
        "gateway_cpu_us_per_msg_mqtt5": round(one.cpu_us_per_msg, 1),
        "gateway_cpu_us_per_msg_mqtt311": round(one311.cpu_us_per_msg, 1),
        # Issue 27's CPU target: the gateway's CPU per message within 1.5 x the reference's.
        "ratio_gateway_cpu_vs_reference_mqtt5": round(
            one.cpu_us_per_msg / reference.cpu_us_per_msg, 2
        ),
        # The MQTT 5 drain with no rules configured, and what the rules cost per message
        # (the difference of the two drains' CPU per message).
        "gateway_norules_msgs_per_s": round(norules.rate),
        "gateway_norules_cpu_us_per_msg": round(norules.cpu_us_per_msg, 1),
        "gateway_rules_cpu_us_per_msg": round(one.cpu_us_per_msg - norules.cpu_us_per_msg, 1),
        "ratio_gateway_norules_cpu_vs_reference": round(
            norules.cpu_us_per_msg / reference.cpu_us_per_msg, 2
        ),
        # Round trips (statements, BEGIN and COMMIT included) and messages per ingest
        # transaction, the MQTT 5 drain's and the live phase's (issue 27).
        "gateway_statements_per_batch": _rounded(one.statements_per_batch, 2),
        "gateway_messages_per_batch": _rounded(one.messages_per_batch, 1),
        "gateway_live_statements_per_batch": _rounded(one_live.statements_per_batch, 2),
        "gateway_live_messages_per_batch": _rounded(one_live.messages_per_batch, 1),
        "gateway_live_cpu_us_per_msg": round(one_live.cpu_us_per_msg, 1),
        "gateway_tasmota_msgs_per_s": round(tasmota.rate),
        "gateway_tasmota_cpu_us_per_msg": round(tasmota.cpu_us_per_msg, 1),
        "ratio_tasmota_vs_gateway": round(tasmota.rate / one.rate, 3),
        "gateway_sparkplug_msgs_per_s": round(spb.rate),
        "gateway_sparkplug_cpu_us_per_msg": round(spb.cpu_us_per_msg, 1),
        "ratio_sparkplug_vs_gateway": round(spb.rate / one.rate, 3),
        **{
            field: value
            for fmt, drain in vendors.items()
            for field, value in (
                (f"gateway_{_key(fmt)}_msgs_per_s", round(drain.rate)),
                (f"gateway_{_key(fmt)}_cpu_us_per_msg", round(drain.cpu_us_per_msg, 1)),
                (f"ratio_{_key(fmt)}_vs_gateway", round(drain.rate / one.rate, 3)),
            )
        },
        "ratio_gateway_vs_bare": round(one.rate / bare.rate, 3),
        "ratio_gateway_vs_naive": round(one.rate / naive.rate, 2),
        "ratio_gateway_vs_native": round(one.rate / native.rate, 3),
        "ratio_two_vs_one": round(two_live.rate / one_live.rate, 3),
        "ratio_three_vs_one": round(three_live.rate / one_live.rate, 3),
        **scaling_fields({"gateway_live": one_live, "gateway2": two_live, "gateway3": three_live}),
        "shared_devices": SHARED_DEVICES,
        "gateway_live_alarms_expected": one_alarms.expected,
        "gateway_live_alarms_found": one_alarms.found,
        "gateway_live_cleared_expected": one_alarms.cleared_expected,
        "gateway_live_cleared_found": one_alarms.cleared_found,
        "gateway2_alarms_expected": two_alarms.expected,
        "gateway2_alarms_found": two_alarms.found,
        "gateway2_cleared_expected": two_alarms.cleared_expected,
        "gateway2_cleared_found": two_alarms.cleared_found,
        "gateway2_devices_on_both_nodes": two_alarms.devices_on_several_nodes,
        "gateway3_alarms_expected": three_alarms.expected,
        "gateway3_alarms_found": three_alarms.found,
        "gateway3_cleared_expected": three_alarms.cleared_expected,
        "gateway3_cleared_found": three_alarms.cleared_found,
        "gateway3_devices_on_several_nodes": three_alarms.devices_on_several_nodes,
        # Three nodes may show two of a device's episodes as one (the ordering rule's documented
        # limit, docs/rules-and-alarms.md): a normal run's samples, on two nodes, committed after
        # the next violation, on the third. Never more alarms than one node decides.
        "gateway3_runs_merged": three_alarms.expected - three_alarms.found,
        "gateway3_no_extra_alarms": three_alarms.found <= three_alarms.expected
        and three_alarms.cleared_found <= three_alarms.cleared_expected,
        "alarms_match": one_alarms.matches and two_alarms.matches,
        "latency_rate_msgs_per_s": round(latency.rate),
        "latency_messages": latency.timings.count,
        "latency_p50_ms": round(latency.timings.p50_ms, 2),
        "latency_p95_ms": round(latency.timings.p95_ms, 2),
        "latency_p99_ms": round(latency.timings.p99_ms, 2),
        "latency_max_ms": round(latency.timings.max_ms, 2),
        "storm_devices": storm.devices,
        "storm_seconds": round(storm.seconds, 3),
        "storm_alarms": storm.alarms,
        "storm_alarmed_devices": storm.alarmed_devices,
        "commands": commands.burst,
        "command_devices": sizes.command_devices,
        "commands_acked": commands.burst_acked,
        "commands_per_s": round(commands.per_s),
        "commands_paced_per_s": round(commands.paced_rate),
        "commands_p50_ms": round(commands.timings.p50_ms, 2),
        "commands_p99_ms": round(commands.timings.p99_ms, 2),
        "campaign_devices": campaign.devices,
        "campaign_acked": campaign.acked,
        "campaign_commands_per_s": round(campaign.per_s),
        # Every command ACKED exactly once in its generation (1 is true).
        "campaign_acked_once": int(campaign.acked_once),
        **cpu_fields("commands", commands.burst_cpu, commands.burst_acked),
        **cpu_fields("campaign", campaign.cpu, campaign.acked),
        "rss_mb": round(max(one.rss_mb, one311.rss_mb, storm.rss_mb), 1),
        "rss_all_phases_mb": round(
            max(
                one.rss_mb,
                one311.rss_mb,
                norules.rss_mb,
                tasmota.rss_mb,
                spb.rss_mb,
                *(drain.rss_mb for drain in vendors.values()),
                one_live.rss_mb,
                two_live.rss_mb,
                three_live.rss_mb,
                storm.rss_mb,
            ),
            1,
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
    }


def scaling_fields(live: dict[str, Drain]) -> dict[str, Any]:
    """Per live phase (1, 2, 3 nodes): the gateways' CPU per message (all nodes together),
    PostgreSQL's backends' for the bench database and its server processes' (None where the
    server is not on this machine); and, from the widest phase, how many gateway cores one
    PostgreSQL core keeps busy: the ratio of the gateways' cost to the backends' and server's
    together, the node-cores one primary serves per core of its own."""

    def us(value: float | None) -> float | None:
        return None if value is None else round(value, 1)

    fields: dict[str, Any] = {}
    for phase, drain in live.items():
        fields[f"{phase}_gateway_cpu_us_per_msg"] = round(drain.cpu_us_per_msg, 1)
        fields[f"{phase}_pg_cpu_us_per_msg"] = us(drain.pg_cpu_us_per_msg)
        fields[f"{phase}_pg_server_cpu_us_per_msg"] = us(drain.pg_server_cpu_us_per_msg)
    widest = list(live.values())[-1]
    pg = (widest.pg_cpu_us_per_msg or 0.0) + (widest.pg_server_cpu_us_per_msg or 0.0)
    fields["gateway_cores_per_pg_core"] = (
        None
        if widest.pg_cpu_us_per_msg is None or pg <= 0
        else round(widest.cpu_us_per_msg / pg, 2)
    )
    return fields


def cpu_fields(phase: str, split: CpuSplit, units: int) -> dict[str, Any]:
    """A phase's CPU per unit of work for each party (µs; None for a party not on this
    machine), their total, how busy the machine was (%), and the rate its cores could carry
    at that total: ``cores / total``."""
    per_unit = split.per_unit_us(units)
    known = [value for value in per_unit.values() if value is not None]
    total = sum(known)
    cores = os.cpu_count() or 1
    fields: dict[str, Any] = {}
    for party in PARTIES:
        used = per_unit.get(party)
        fields[f"{phase}_cpu_us_{party}"] = None if used is None else round(used)
    fields[f"{phase}_cpu_us_total"] = round(total)
    fields[f"{phase}_machine_busy_pct"] = round(split.busy * 100, 1)
    fields[f"{phase}_cpu_ceiling_per_s"] = round(cores / total * 1e6) if total > 0 else 0
    return fields


def _note(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def _progress(name: str, drain: Drain) -> Drain:
    print(
        f"  {name:<11} {drain.rate:>10,.0f} msg/s  ({drain.messages} in {drain.seconds:.2f} s)",
        file=sys.stderr,
        flush=True,
    )
    return drain


# (JSON key, comparison, bound) — the targets, shown next to each figure.
TARGETS: dict[str, tuple[str, float]] = {
    "ratio_gateway_vs_bare_mqtt5": (">=", 4.0),
    "ratio_gateway_vs_reference_mqtt5": (">=", 0.6),
    "gateway_cpu_us_per_msg_mqtt5": ("<=", 40.0),
    "ratio_gateway_cpu_vs_reference_mqtt5": ("<=", 1.5),
    "ratio_gateway_vs_naive": (">=", 4.0),
    "ratio_two_vs_one": (">=", 1.6),
    "latency_p99_ms": ("<", 50.0),
    "storm_seconds": ("<", 2.0),
    "commands_per_s": (">=", 1000.0),
    "commands_p99_ms": ("<", 100.0),
    "campaign_commands_per_s": (">=", 3000.0),
    "campaign_acked_once": (">=", 1.0),
    "rss_mb": ("<", 100.0),
    # Found equals expected, raised and cleared, in both live phases (1 is true).
    "alarms_match": (">=", 1.0),
}
# The streams phase's (``--phase streams``, not part of a full run).
STREAMS_TARGETS: dict[str, tuple[str, float]] = {"ratio_streams_vs_none": (">=", 0.8)}


def target_met(key: str, value: float) -> bool | None:
    """Whether ``value`` meets the target for ``key``; None where there is none."""
    if key not in TARGETS:
        return None
    op, bound = TARGETS[key]
    if op == ">=":
        return value >= bound
    return value <= bound if op == "<=" else value < bound


def _cpu_rows(r: dict[str, Any], phase: str, name: str) -> list[tuple[str, str, str]]:
    """Who used the CPU per command of a phase, and what rate that leaves the machine."""
    split = " / ".join(
        "n/a" if r[f"{phase}_cpu_us_{party}"] is None else f"{r[f'{phase}_cpu_us_{party}']:,}"
        for party in PARTIES
    )
    return [
        (
            f"{name}: CPU/command, gateway / PG / broker / sim",
            f"{split} us",
            "",
        ),
        (
            f"{name}: CPU/command, all; machine busy",
            f"{r[f'{phase}_cpu_us_total']:,} us; {r[f'{phase}_machine_busy_pct']:.0f} %",
            "",
        ),
        (
            f"{name}: most the cores carry at that cost",
            f"{r[f'{phase}_cpu_ceiling_per_s']:,} /s",
            "",
        ),
    ]


def _scaling_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    """CPU per message of the gateways and of PostgreSQL, live with 1, 2 and 3 processes."""

    def us(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    rows = [
        (
            f"live, {n} process{'es' if n > 1 else ''}: CPU/msg gateways / PG backends / server",
            f"{us(r[f'{phase}_gateway_cpu_us_per_msg'])}"
            f" / {us(r[f'{phase}_pg_cpu_us_per_msg'])}"
            f" / {us(r[f'{phase}_pg_server_cpu_us_per_msg'])} us",
            "",
        )
        for n, phase in ((1, "gateway_live"), (2, "gateway2"), (3, "gateway3"))
    ]
    cores = r["gateway_cores_per_pg_core"]
    rows.append(
        ("gateway cores per PostgreSQL core (3 live)", "n/a" if cores is None else f"{cores}", "")
    )
    return rows


def render_table(result: dict[str, Any]) -> str:
    r = result
    rows: list[tuple[str, str, str]] = [
        ("bare aiomqtt + manual ack (ceiling)", f"{r['bare_msgs_per_s']:,} msg/s", ""),
        ("mosquitto_sub (native)", f"{r['native_msgs_per_s']:,} msg/s", ""),
        ("reference: minimal exactly-once consumer", f"{r['reference_msgs_per_s']:,} msg/s", ""),
        ("reference CPU per message", f"{r['reference_cpu_us_per_msg']:.1f} us", ""),
        ("gateway, 1 process (drain, MQTT 5)", f"{r['gateway_msgs_per_s']:,} msg/s", ""),
        (
            "gateway, 1 process (drain, MQTT 3.1.1)",
            f"{r['gateway_msgs_per_s_mqtt311']:,} msg/s",
            "",
        ),
        (
            "gateway CPU per message (MQTT 5 drain)",
            f"{r['gateway_cpu_us_per_msg_mqtt5']:.1f} us",
            "gateway_cpu_us_per_msg_mqtt5",
        ),
        (
            "gateway CPU per message (MQTT 3.1.1 drain)",
            f"{r['gateway_cpu_us_per_msg_mqtt311']:.1f} us",
            "",
        ),
        (
            "gateway CPU / reference CPU per message (MQTT 5)",
            f"{r['ratio_gateway_cpu_vs_reference_mqtt5']:.2f}",
            "ratio_gateway_cpu_vs_reference_mqtt5",
        ),
        (
            "gateway CPU per message, no rules (MQTT 5 drain)",
            f"{r['gateway_norules_cpu_us_per_msg']:.1f} us"
            f" ({r['ratio_gateway_norules_cpu_vs_reference']:.2f} x reference;"
            f" {r['gateway_norules_msgs_per_s']:,} msg/s)",
            "",
        ),
        (
            "CPU per message the rules cost (MQTT 5 drain)",
            f"{r['gateway_rules_cpu_us_per_msg']:.1f} us",
            "",
        ),
        (
            "gateway / reference (MQTT 5)",
            f"{r['ratio_gateway_vs_reference_mqtt5']:.2f}",
            "ratio_gateway_vs_reference_mqtt5",
        ),
        ("gateway / reference (MQTT 3.1.1)", f"{r['ratio_gateway_vs_reference_mqtt311']:.2f}", ""),
        *(
            (
                f"round trips per batch ({phase})",
                f"{r[f'{key}_statements_per_batch']} ({r[f'{key}_messages_per_batch']} msg)",
                "",
            )
            for phase, key in (("MQTT 5 drain", "gateway"), ("live", "gateway_live"))
            if r.get(f"{key}_statements_per_batch") is not None
        ),
        (
            "gateway, 1 process (drain, Tasmota JSON mapped)",
            f"{r['gateway_tasmota_msgs_per_s']:,} msg/s",
            "",
        ),
        (
            "gateway CPU per message (Tasmota JSON mapped)",
            f"{r['gateway_tasmota_cpu_us_per_msg']:.1f} us",
            "",
        ),
        ("Tasmota mapped / native (drain)", f"{r['ratio_tasmota_vs_gateway']:.2f}", ""),
        (
            "gateway, 1 process (drain, Sparkplug B)",
            f"{r['gateway_sparkplug_msgs_per_s']:,} msg/s",
            "",
        ),
        (
            "gateway CPU per message (Sparkplug B)",
            f"{r['gateway_sparkplug_cpu_us_per_msg']:.1f} us",
            "",
        ),
        ("Sparkplug B / native (drain)", f"{r['ratio_sparkplug_vs_gateway']:.2f}", ""),
        *(
            row
            for fmt in OTHER_VENDOR_FORMATS
            if f"gateway_{_key(fmt)}_msgs_per_s" in r
            for row in (
                (
                    f"gateway, 1 process (drain, {fmt} mapped)",
                    f"{r[f'gateway_{_key(fmt)}_msgs_per_s']:,} msg/s",
                    "",
                ),
                (
                    f"gateway CPU per message ({fmt} mapped)",
                    f"{r[f'gateway_{_key(fmt)}_cpu_us_per_msg']:.1f} us",
                    "",
                ),
            )
        ),
        ("gateway, 1 process, live publisher", f"{r['gateway_live_msgs_per_s']:,} msg/s", ""),
        ("gateway, 2 processes ($share), live", f"{r['gateway2_msgs_per_s']:,} msg/s", ""),
        ("gateway, 3 processes ($share), live", f"{r['gateway3_msgs_per_s']:,} msg/s", ""),
        *_scaling_rows(r),
        ("naive: one commit per message", f"{r['naive_msgs_per_s']:,} msg/s", ""),
        (
            "gateway / bare (MQTT 5)",
            f"{r['ratio_gateway_vs_bare_mqtt5']:.2f}",
            "ratio_gateway_vs_bare_mqtt5",
        ),
        ("gateway / bare (MQTT 3.1.1)", f"{r['ratio_gateway_vs_bare_mqtt311']:.2f}", ""),
        ("gateway / native", f"{r['ratio_gateway_vs_native']:.3f}", ""),
        ("gateway / naive", f"{r['ratio_gateway_vs_naive']:.1f}x", "ratio_gateway_vs_naive"),
        ("two processes / one", f"{r['ratio_two_vs_one']:.2f}", "ratio_two_vs_one"),
        ("three processes / one", f"{r['ratio_three_vs_one']:.2f}", ""),
        (
            f"alarms, live on {r['shared_devices']} shared devices: 1 process",
            f"{r['gateway_live_alarms_found']:,} / {r['gateway_live_alarms_expected']:,}"
            f" ({r['gateway_live_cleared_found']:,} / {r['gateway_live_cleared_expected']:,}"
            " cleared)",
            "",
        ),
        (
            f"alarms, 2 processes ({r['gateway2_devices_on_both_nodes']} devices on both)",
            f"{r['gateway2_alarms_found']:,} / {r['gateway2_alarms_expected']:,}"
            f" ({r['gateway2_cleared_found']:,} / {r['gateway2_cleared_expected']:,}"
            " cleared)",
            "alarms_match",
        ),
        (
            f"alarms, 3 processes ({r['gateway3_devices_on_several_nodes']} devices on several)",
            f"{r['gateway3_alarms_found']:,} / {r['gateway3_alarms_expected']:,}"
            f" ({r['gateway3_cleared_found']:,} / {r['gateway3_cleared_expected']:,}"
            f" cleared; {r['gateway3_runs_merged']:,} episodes merged)",
            "",
        ),
        (
            f"latency at {r['latency_rate_msgs_per_s']:,} msg/s: p50 / p95",
            f"{r['latency_p50_ms']:.1f} / {r['latency_p95_ms']:.1f} ms",
            "",
        ),
        ("latency p99 (publish -> commit)", f"{r['latency_p99_ms']:.1f} ms", "latency_p99_ms"),
        (
            f"alarm storm: {r['storm_devices']:,} devices",
            f"{r['storm_seconds']:.2f} s",
            "storm_seconds",
        ),
        (
            "alarm storm: alarms / devices alarmed",
            f"{r['storm_alarms']:,} / {r['storm_alarmed_devices']:,}",
            "",
        ),
        (
            f"commands: {r['commands']:,} to {r['command_devices']:,} devices",
            f"{r['commands_per_s']:,} /s ({r['commands_acked']:,} ACKED)",
            "commands_per_s",
        ),
        (f"command p50 at {r['commands_paced_per_s']:,} /s", f"{r['commands_p50_ms']:.1f} ms", ""),
        ("command p99 (creation -> ACKED)", f"{r['commands_p99_ms']:.1f} ms", "commands_p99_ms"),
        *_cpu_rows(r, "commands", "command burst"),
        (
            f"campaign: 1 request to {r['campaign_devices']:,} devices",
            f"{r['campaign_commands_per_s']:,} /s ({r['campaign_acked']:,} ACKED)",
            "campaign_commands_per_s",
        ),
        (
            "campaign: each ACKED once in its generation",
            "yes" if r["campaign_acked_once"] else "NO",
            "campaign_acked_once",
        ),
        *_cpu_rows(r, "campaign", "campaign"),
        ("gateway peak RSS (drain, storm)", f"{r['rss_mb']} MB", "rss_mb"),
    ]
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    lines = [f"backlog: {r['messages']:,} QoS 1 messages ({r['machine']})"]
    for name, value, key in rows:
        line = f"{name:<{width}}  {value:>{value_width}}"
        if key:
            op, bound = TARGETS[key]
            verdict = "ok" if target_met(key, float(r[key])) else "MISSED"
            wanted = (
                "found = expected"
                if key == "alarms_match"
                else "every one"
                if key == "campaign_acked_once"
                else f"{op} {bound:g}"
            )
            line += f"  target {wanted}: {verdict}"
        lines.append(line.rstrip())
    return "\n".join(lines)
