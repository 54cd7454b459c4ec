"""``gateway-sim field``: real daemons in field conditions, checked against a reference model.

One seed (docs/field-simulation.md): a plan of device streams and faults (`sim.field_plan`),
played against real processes — N ``gateway run`` nodes in one ``$share`` group, a mosquitto
with persistence, PostgreSQL, a webhook receiver — and then checked:

- every message sent is stored exactly once (twice-sent ones included), and a maintenance
  pass keeps the samples of a clock months behind;
- the alarms equal the reference model's: ``gateway rules replay`` (the pure evaluator, one
  node reading each device's stream in its true order, each message judged at the receipt the
  database recorded for it). For devices whose clock jumped (judged in arrival order) only
  which alarms exist is compared; for the others which superseded which, and which cleared;
- the inactivity rule a reload added fired once for each silent device and for no other;
- every CRITICAL alarm reached the webhook; no alarm is left NEW or DELAYED (a reload took
  the quiet hours away); no ``command-reclaims`` alarm came of the broker outage, and every
  command pending through it, a campaign's included, was sent once the broker was back.

A failing seed prints the command that replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import aiohttp
import aiomqtt
import asyncpg
from aiohttp import web

from protocol import Topics
from protocol.events import EventType
from sim.broker import mosquitto_binary, wait_listening
from sim.field_plan import (
    EPOCH,
    HOLD_S,
    JUMPY,
    Fault,
    Plan,
    Sent,
    describe,
    make_plan,
    outage_seconds,
    silent_seconds,
)
from sim.gateways import wait_healthy as gateway_healthy
from sim.ports import free_port

PREFIX: Final = "field"
TOKEN: Final = secrets.token_urlsafe(24)
LEASE_S: Final = 1.0
TIMER_S: Final = 1.0
SETTLE_TIMEOUT_S: Final = 60.0
COMMANDS_SENT_TIMEOUT_S: Final = 30.0

RULES: Final = f"""
[[rules]]
key = "sos"
kind = "event"
event = "SOS"
severity = "CRITICAL"

[[rules]]
key = "door"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"

[[rules]]
key = "hot"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
severity = "MAJOR"

[[rules]]
key = "held"
kind = "threshold"
metric = "p"
op = ">"
value = 10
for_seconds = {HOLD_S}
severity = "WARNING"
"""


def _silent_rule(seconds: float) -> str:
    return (
        '\n[[rules]]\nkey = "silent"\nkind = "inactivity"\n'
        f'devices = ["steady-*", "silent-*"]\nsilent_seconds = {seconds}\nseverity = "MAJOR"\n'
    )


def _quiet_window(now: datetime) -> str:
    start = (now - timedelta(minutes=1)).strftime("%H:%M")
    end = (now + timedelta(minutes=60)).strftime("%H:%M")
    return f'\n[[alarms.quiet_hours.windows]]\nstart = "{start}"\nend = "{end}"\n'


class FieldBroker:
    """mosquitto on a fixed port with persistence: stopped and started again, it keeps the
    nodes' sessions and what was queued for them (as a broker under maintenance does)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "user root\n"
            "persistence true\n"
            f"persistence_location {workdir}/\n"
            "max_inflight_messages 100\n"
            "max_queued_messages 0\n"
            f"log_dest file {workdir / 'mosquitto.log'}\n"
        )
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            [mosquitto_binary(), "-c", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_listening(self.port, timeout_s=20)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()  # it writes its persistence file on the way out
            self._process.wait(timeout=30)
            self._process = None


class Webhook:
    """The person-facing receiver: every alarm event the nodes deliver, by alarm id."""

    def __init__(self) -> None:
        self.port = free_port()
        self.received: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None

    async def _hook(self, request: web.Request) -> web.Response:
        self.received.append(await request.json())
        return web.Response(status=204)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self._hook)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def alarm_ids(self, event: str) -> set[int]:
        return {int(b["alarm_id"]) for b in self.received if b.get("event") == event}


@dataclass
class Node:
    index: int
    config: Path
    http_port: int
    log: Path
    process: asyncio.subprocess.Process | None = None
    starts: int = 0


class Nodes:
    """The ``gateway run`` processes, one config file each, rewritten for reloads."""

    def __init__(
        self, count: int, *, workdir: Path, broker_port: int, dsn: str, hook_url: str
    ) -> None:
        self.workdir = workdir
        self.broker_port = broker_port
        self.dsn = dsn
        self.hook_url = hook_url
        self.extra = ""
        self.nodes = [
            Node(n, workdir / f"node-{n}.toml", free_port(), workdir / f"node-{n}.log")
            for n in range(count)
        ]
        self.write_configs()

    def config_text(self, node: Node) -> str:
        return (
            f'[node]\nid = "field-{node.index}"\nstate_dir = "{self.workdir}/state-{node.index}"\n'
            f'[mqtt]\nhost = "127.0.0.1"\nport = {self.broker_port}\n'
            f'topic_prefix = "{PREFIX}"\nshared_group = "{PREFIX}"\nprotocol = "5"\n'
            f'[database]\ndsn = "{self.dsn}"\n'
            # A shared group chooses one transaction at a time; the simulation runs two, so
            # that every fault also meets transactions stored beside each other.
            "[ingest]\ntransactions_in_flight = 2\n"
            f"[http]\nport = {node.http_port}\n"
            '[log]\nformat = "json"\nlevel = "info"\n'
            "[retention]\ntelemetry_days = 30\n"
            f"[alarms]\ntimer_interval_s = {TIMER_S}\nunreached_after_s = 60\n"
            f"[commands]\nlease_s = {LEASE_S}\nack_window_s = 3600\nreaper_interval_s = 0.2\n"
            "[outbox]\nretry_max_s = 2\n"
            "[notify]\npoll_s = 0.5\nbackoff_max_s = 2\n"
            f'[[notify.receivers]]\nname = "field-hook"\nkind = "webhook"\n'
            f'url = "{self.hook_url}"\n'
            f'[[notify.routes]]\nevents = ["{EventType.ALARM_CREATED}"]\n'
            'receivers = ["field-hook"]\n'
            f'[[api.tokens]]\ntoken = "{TOKEN}"\nrole = "operator"\nname = "field"\n'
            f"{RULES}{self.extra}"
        )

    def write_configs(self) -> None:
        for node in self.nodes:
            node.config.write_text(self.config_text(node))

    async def start(self, node: Node) -> None:
        with node.log.open("ab") as log:
            node.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway",
                "run",
                "--config",
                str(node.config),
                stdout=log,
                stderr=log,
            )
        node.starts += 1

    async def start_all(self) -> None:
        for node in self.nodes:
            await self.start(node)
        async with aiohttp.ClientSession() as http:
            for node in self.nodes:
                await wait_healthy(http, node, timeout_s=120)

    async def subscribed(self) -> None:
        """Every node healthy again (its subscription made)."""
        async with aiohttp.ClientSession() as http:
            for node in self.nodes:
                await wait_healthy(http, node, timeout_s=120)

    async def one_subscribed(self) -> None:
        """One node healthy again: the group has a member, so what devices publish now is
        delivered (to it), as a real fleet's messages would be."""
        async with aiohttp.ClientSession() as http:
            waits = [
                asyncio.create_task(wait_healthy(http, node, timeout_s=120)) for node in self.nodes
            ]
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        return
                # The first to end ended badly (its node exited): wait for the others.
                await asyncio.gather(*(t for t in waits if t not in done))
            finally:
                for task in waits:
                    task.cancel()
                await asyncio.gather(*waits, return_exceptions=True)

    def kill(self, node: Node) -> None:
        if node.process is not None and node.process.returncode is None:
            node.process.send_signal(signal.SIGKILL)

    async def reload(self, extra: str) -> None:
        self.extra = extra
        self.write_configs()
        for node in self.nodes:
            if node.process is not None and node.process.returncode is None:
                node.process.send_signal(signal.SIGHUP)

    async def stop_all(self) -> list[int]:
        codes = []
        for node in self.nodes:
            if node.process is not None and node.process.returncode is None:
                node.process.terminate()
        for node in self.nodes:
            if node.process is not None:
                try:
                    async with asyncio.timeout(60):
                        codes.append(await node.process.wait())
                except TimeoutError:
                    node.process.kill()
                    codes.append(await node.process.wait())
        return codes

    def log_tail(self, lines: int = 15) -> str:
        parts = []
        for node in self.nodes:
            text = node.log.read_text(errors="replace") if node.log.exists() else ""
            parts.append(f"--- node {node.index}:\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts)


async def wait_healthy(http: aiohttp.ClientSession, node: Node, *, timeout_s: float) -> None:
    await gateway_healthy(http, node.http_port, timeout_s, process=node.process)


class Devices:
    """The fleet's publisher: QoS 1, each message until the broker acknowledged it (a device
    keeps what the broker did not take and sends it when the broker is back)."""

    def __init__(self, port: int, topics: Topics) -> None:
        self.port = port
        self.topics = topics
        self.published = 0
        self.reconnects = 0
        # Cleared while the broker is restarted and until every node has subscribed again:
        # mosquitto (2.0.11) does not restore `$share` subscriptions from its persistence
        # file, so what devices publish before the group's members subscribe again is
        # dropped by the broker (docs/deploying.md). The simulation measures the gateway.
        self.broker_ready = asyncio.Event()
        self.broker_ready.set()

    async def play(self, schedule: Sequence[Sent], started: float) -> None:
        position = 0
        while position < len(schedule):
            try:
                async with aiomqtt.Client(
                    "127.0.0.1", self.port, identifier=f"field-devices-{os.getpid()}"
                ) as client:
                    while position < len(schedule):
                        sent = schedule[position]
                        delay = started + sent.at - time.monotonic()
                        if delay > 0:
                            await asyncio.sleep(delay)  # the device's own schedule
                        await self.broker_ready.wait()
                        topic = self.topics.telemetry(sent.device_id)
                        await client.publish(topic, sent.payload, qos=1)
                        if sent.duplicate:
                            await client.publish(topic, sent.payload, qos=1)
                        self.published += 1
                        position += 1
            except aiomqtt.MqttError:
                self.reconnects += 1
                await asyncio.sleep(0.2)  # a device's reconnect backoff, not a synchronisation


@dataclass
class Discrepancy:
    what: str
    detail: str

    def __str__(self) -> str:
        return f"{self.what}: {self.detail}"


@dataclass
class FieldResult:
    seed: int
    nodes: int
    devices: int
    messages: int
    duplicates: int
    faults: list[str]
    alarms_checked: int = 0
    merged_runs: int = 0  # see _runs: the ordering rule's measured limit
    # Inactivity alarms of talking devices raised after the plan ended, a full silence after
    # their last message: right, and not counted against the gateway (_check_inactivity).
    silent_after_end: int = 0
    # Holds the model fires that a sample received within a timer interval cleared first
    # (_check_alarms, timer_race): listed, not failed.
    timer_races: list[Discrepancy] = field(default_factory=list)
    # Differences where the nodes committed a device's samples out of order across runs of a
    # threshold rule: the ordering rule's documented limit, reported, not failed (see _runs).
    ordering_limits: list[Discrepancy] = field(default_factory=list)
    alarms_expected: int = 0
    discrepancies: list[Discrepancy] = field(default_factory=list)
    seconds: float = 0.0
    replay: str = ""

    @property
    def ok(self) -> bool:
        return not self.discrepancies

    def as_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "nodes": self.nodes,
            "devices": self.devices,
            "messages": self.messages,
            "duplicates": self.duplicates,
            "faults": self.faults,
            "alarms_checked": self.alarms_checked,
            "alarms_expected": self.alarms_expected,
            "merged_runs": self.merged_runs,
            "silent_after_end": self.silent_after_end,
            "timer_races": [str(d) for d in self.timer_races],
            "ordering_limits": [str(d) for d in self.ordering_limits],
            "discrepancies": [str(d) for d in self.discrepancies],
            "seconds": round(self.seconds, 1),
        }


async def _admin(dsn: str) -> asyncpg.Connection:
    return await asyncpg.connect(dsn, database="postgres")


@contextlib.asynccontextmanager
async def _database(server_dsn: str, seed: int, *, keep: list[bool]) -> AsyncIterator[str]:
    """A database for one seed, dropped afterwards unless ``keep[0]`` is then true."""
    from sim.bench import _with_database

    name = f"field_{seed}_{secrets.token_hex(3)}"
    admin = await _admin(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield _with_database(server_dsn, name)
    finally:
        if keep[0]:
            print(f"database kept: {_with_database(server_dsn, name)}", file=sys.stderr)
        else:
            admin = await _admin(server_dsn)
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            finally:
                await admin.close()


def _workdir(seed: int, keep: Path | None) -> Path:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"gw-field-{seed}-", dir=keep))


def replay_command(seed: int, *, minutes: float, nodes: int, devices: int) -> str:
    return (
        f"gateway-sim field --seed {seed} --nodes {nodes} --minutes {minutes:g} --devices {devices}"
    )


async def run_field(
    seed: int,
    *,
    minutes: float,
    nodes: int,
    devices: int,
    server_dsn: str,
    keep: Path | None = None,
) -> FieldResult:
    """Run one seed end to end; the result lists every discrepancy with the model."""
    began = time.monotonic()
    workdir = _workdir(seed, keep)
    broker = FieldBroker(workdir)
    hook = Webhook()
    # A seed with a discrepancy keeps its database and logs for whoever looks into it.
    kept = [keep is not None]
    try:
        async with _database(server_dsn, seed, keep=kept) as dsn:
            await hook.start()
            broker.start()
            fleet = Nodes(
                nodes,
                workdir=workdir,
                broker_port=broker.port,
                dsn=dsn,
                hook_url=f"http://127.0.0.1:{hook.port}/hook",
            )
            try:
                await fleet.start_all()
                plan = make_plan(seed, minutes=minutes, nodes=nodes, devices=devices)
                result = FieldResult(
                    seed,
                    nodes,
                    len(plan.devices),
                    plan.unique(),
                    plan.duplicates(),
                    [f"{f.kind}@{f.at:g}s" for f in plan.faults],
                    replay=replay_command(seed, minutes=minutes, nodes=nodes, devices=devices),
                )
                await _play(plan, fleet, broker, dsn)
                await _check(plan, fleet, hook, dsn, result)
            except BaseException:
                print(fleet.log_tail(), file=sys.stderr)
                raise
            finally:
                codes = await fleet.stop_all()
            if any(code != 0 for code in codes):
                result.discrepancies.append(
                    Discrepancy("node exit", f"exit codes {codes} at SIGTERM")
                )
            kept[0] = kept[0] or not result.ok
    finally:
        await hook.stop()
        broker.stop()
        if kept[0]:
            print(f"logs kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result.seconds = time.monotonic() - began
    return result


async def _play(plan: Plan, fleet: Nodes, broker: FieldBroker, dsn: str) -> None:
    started = time.monotonic()
    devices = Devices(broker.port, Topics(PREFIX))
    play = asyncio.create_task(devices.play(plan.schedule(), started), name="devices")
    try:
        for fault in plan.faults:
            delay = started + fault.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the plan's own schedule
            await _inject(fault, plan, fleet, broker, dsn, devices)
        await play
    finally:
        play.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await play


async def _inject(  # noqa: PLR0917 - the run's parts, each used by some fault
    fault: Fault, plan: Plan, fleet: Nodes, broker: FieldBroker, dsn: str, devices: Devices
) -> None:
    if fault.kind == "kill_node":
        node = fleet.nodes[fault.node]
        fleet.kill(node)
        if node.process is not None:
            await node.process.wait()
        await fleet.start(node)
        # Up before the next fault: a service manager sends no reload to a unit still
        # starting (a SIGHUP before the daemon's handler exists would end it).
        await fleet.subscribed()
    elif fault.kind == "broker_restart":
        devices.broker_ready.clear()
        broker.stop()
        broker.start()
        await fleet.one_subscribed()
        devices.broker_ready.set()
        await fleet.subscribed()  # every node back before the next fault
    elif fault.kind == "db_cut":
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        finally:
            await conn.close()
    elif fault.kind == "reload_add":
        now = datetime.now(UTC)
        await fleet.reload(_silent_rule(silent_seconds(plan.duration_s)) + _quiet_window(now))
    elif fault.kind == "reload_remove_quiet":
        await fleet.reload(_silent_rule(silent_seconds(plan.duration_s)))
    else:
        devices.broker_ready.clear()
        await _outage(fault, plan, fleet, broker)
        await fleet.one_subscribed()
        devices.broker_ready.set()
        await fleet.subscribed()


async def _outage(fault: Fault, plan: Plan, fleet: Nodes, broker: FieldBroker) -> None:
    """Commands pending, then the broker away for longer than several leases."""
    steady = [d.device_id for d in plan.devices if d.kind == "steady"][:5]
    node = next(n for n in fleet.nodes if n.process is not None and n.process.returncode is None)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        await wait_healthy(http, node, timeout_s=60)
        for device in steady:
            url = f"http://127.0.0.1:{node.http_port}/devices/{device}/commands"
            async with http.post(url, json={"name": "reboot", "params": {}}) as response:
                if response.status >= 300:
                    raise RuntimeError(
                        f"command refused: {response.status} {await response.text()}"
                    )
        # And a campaign over the other devices (a device takes one command at a time), paced
        # so that part of it is still to be dispatched when the broker goes away.
        others = [d.device_id for d in plan.devices if d.device_id not in steady]
        body = {"name": "reboot", "targets": {"devices": others}, "rollout": {"per_minute": 120}}
        url = f"http://127.0.0.1:{node.http_port}/campaigns"
        async with http.post(url, json=body) as response:
            if response.status >= 300:
                raise RuntimeError(f"campaign refused: {response.status} {await response.text()}")
    broker.stop()
    try:
        await asyncio.sleep(fault.seconds)  # the outage itself: the plan's length
    finally:
        broker.start()


async def _check(plan: Plan, fleet: Nodes, hook: Webhook, dsn: str, result: FieldResult) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await _settle(plan, conn)
        await _maintenance(fleet)
        await _check_telemetry(plan, conn, result)
        await _check_alarms(plan, fleet, conn, result)
        await _check_inactivity(plan, conn, result)
        await _check_reach(conn, hook, result)
        await _check_commands(conn, result)
    finally:
        await conn.close()


async def _settle(plan: Plan, conn: asyncpg.Connection) -> None:
    """Every message stored; then past the last hold that could fall due, and a timer pass."""
    wanted = {m.event_id for d in plan.devices for m in d.messages}
    # A message never stored is reported by the telemetry check: waiting ends at the deadline.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(SETTLE_TIMEOUT_S):
            while True:
                stored = await conn.fetchval(
                    "SELECT count(DISTINCT event_id) FROM telemetry"
                    " WHERE event_id = ANY($1::text[])",
                    list(wanted),
                )
                if stored >= len(wanted):
                    break
                await asyncio.sleep(0.5)
        last = await conn.fetchval("SELECT max(received_at) FROM telemetry")
        due = last + timedelta(seconds=HOLD_S + 4 * TIMER_S + 2)
        wait = (due - await conn.fetchval("SELECT now()")).total_seconds()
        if wait > 0:
            await asyncio.sleep(wait)  # a time on the database's clock, not a condition


async def _maintenance(fleet: Nodes) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "maintenance",
        "run-once",
        "--config",
        str(fleet.nodes[0].config),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"gateway maintenance run-once failed: {err.decode()}")


async def _check_telemetry(plan: Plan, conn: asyncpg.Connection, result: FieldResult) -> None:
    rows = await conn.fetch("SELECT event_id, count(*) AS n FROM telemetry GROUP BY event_id")
    stored = {r["event_id"]: r["n"] for r in rows}
    for device in plan.devices:
        for message in device.messages:
            n = stored.pop(message.event_id, 0)
            if n != 1:
                result.discrepancies.append(
                    Discrepancy(
                        "telemetry",
                        f"{device.device_id} message {message.index} stored {n} times",
                    )
                )
    for event_id, n in stored.items():
        result.discrepancies.append(
            Discrepancy("telemetry", f"{event_id} stored {n} times, never sent")
        )


async def _judged_order(conn: asyncpg.Connection) -> dict[str, datetime]:
    """Event id -> when the nodes judged the sample, in the order they did.

    A sample is judged in the transaction that stores it, holding its device's rule-state rows
    until the commit: two samples of one device are judged in the order their transactions
    committed. With PostgreSQL's ``track_commit_timestamp`` on, that is the order read here.
    Otherwise the receipt (the transaction's start) stands in for it, which two nodes storing
    one device's samples at the same moment can invert: a difference that follows is then the
    model's, not the gateway's (docs/field-simulation.md)."""
    if await conn.fetchval("SELECT current_setting('track_commit_timestamp')::bool"):
        query = (
            "SELECT event_id, min(coalesce(pg_xact_commit_timestamp(xmin), received_at)) AS at"
            " FROM telemetry GROUP BY event_id"
        )
    else:
        query = "SELECT event_id, min(received_at) AS at FROM telemetry GROUP BY event_id"
    return {r["event_id"]: r["at"] for r in await conn.fetch(query)}


async def _model(plan: Plan, fleet: Nodes, conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """``gateway rules replay`` on each device's stream in its true order, each message at the
    receipt the database recorded for it, the hold timer run up to the database's now."""
    receipts = {
        r["event_id"]: r["received_at"]
        for r in await conn.fetch(
            "SELECT event_id, min(received_at) AS received_at FROM telemetry GROUP BY event_id"
        )
    }
    judged = await _judged_order(conn)
    until = await conn.fetchval("SELECT now()")
    lines = []
    for device in plan.devices:
        order = device.messages  # the device's true order
        if device.kind in JUMPY:
            # After its clock jumped, a device's samples are judged at their receipt, in
            # arrival order (docs/rules-and-alarms.md, "Device clocks"): the order the
            # nodes judged them in, which faults shuffle, is the true order then.
            order = sorted(
                (m for m in order if m.event_id in judged),
                key=lambda m: (judged[m.event_id], m.index),
            )
        for message in order:
            received = receipts.get(message.event_id)
            if received is None:
                continue  # lost: reported by the telemetry check
            lines.append(
                json.dumps(
                    {
                        "device_id": device.device_id,
                        "received_at": received.isoformat(),
                        "message": json.loads(message.payload),
                    }
                )
            )
    stream = fleet.workdir / "model-input.jsonl"
    stream.write_text("\n".join(lines) + "\n")
    model_config = fleet.workdir / "model.toml"
    model_config.write_text(f"{RULES}")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "rules",
        "replay",
        "--config",
        str(model_config),
        "--input",
        str(stream),
        "--until",
        until.isoformat(),
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"gateway rules replay failed: {err.decode()}")
    return [json.loads(line) for line in out.decode().splitlines() if line.strip()]


MODEL_RULES: Final = ("sos", "door", "hot", "held")
EVENT_RULES: Final = ("sos", "door")


# Threshold rules: which sample of a run of violations raises its alarm (and which of the run
# of normal samples after it clears it) depends on the order the nodes committed them: the
# ordering rule promises the effect of the device order where nothing newer already stands
# for a late sample, not the same sample (docs/rules-and-alarms.md, "The ordering rule"). So
# a threshold alarm is compared by its run: one alarm per run, cleared by the run after it.
THRESHOLDS: Final = {"hot": ("temp", 80.0), "held": ("p", 10.0)}


def _runs(  # noqa: PLR0912 - one pass over each device's runs, every case of it here
    plan: Plan, receipts: dict[str, datetime], result: FieldResult
) -> tuple[dict[tuple[str, str], str], dict[tuple[str, datetime], str], set[tuple[str, str]]]:
    """(rule, telemetry event id) -> the run of its sample, in the device's true order.

    One limit of the ordering rule is measured here instead of reported as a discrepancy: a
    run of normal samples that the nodes committed only after the first violation of the run
    that follows it (a broker outage's backlog shared out among nodes) was, to the gateway,
    never there. The violation goes on: the three runs are one alarm, cleared by the next
    normal run (docs/rules-and-alarms.md, "The ordering rule"). Such runs are merged into the
    run before them, and counted in `merged_runs`."""
    runs: dict[tuple[str, str], str] = {}
    # A hold timer's alarm has no sample of its own: its trigger names the run's first
    # violation by its time (`pending_since`), which finds the run.
    since_runs: dict[tuple[str, datetime], str] = {}
    times: dict[str, datetime] = {}
    # (device, rule) whose samples the nodes committed out of order across runs.
    crossed: set[tuple[str, str]] = set()
    for device in plan.devices:
        if device.kind in JUMPY:
            continue  # judged in arrival order: compared by their own samples
        for rule, (metric, limit) in THRESHOLDS.items():
            sequence: list[tuple[bool, list[str]]] = []
            for message in device.messages:
                body = json.loads(message.payload)
                value = body.get("metrics", {}).get(metric)
                if value is None:
                    continue
                times[message.event_id] = EPOCH + timedelta(milliseconds=body["ts"])
                violating = value > limit
                if not sequence or sequence[-1][0] != violating:
                    sequence.append((violating, []))
                sequence[-1][1].append(message.event_id)
            latest: datetime | None = None
            for _, members in sequence:
                got = [receipts[e] for e in members if e in receipts]
                if not got:
                    continue
                if latest is not None and min(got) < latest:
                    crossed.add((device.device_id, rule))
                latest = max(got) if latest is None else max(latest, *got)
            labels = list(range(len(sequence)))
            for k in range(1, len(sequence) - 1):
                violating, members = sequence[k]
                following = sequence[k + 1][1]
                if violating or not all(e in receipts for e in members + following):
                    continue
                if min(receipts[e] for e in following) < min(receipts[e] for e in members):
                    labels[k] = labels[k + 1] = labels[k - 1]
                    result.merged_runs += 1
            for k, (_, members) in enumerate(sequence):
                for event_id in members:
                    runs[(rule, event_id)] = f"run {labels[k]}"
                    since_runs[(device.device_id, times[event_id])] = f"run {labels[k]}"
    return runs, since_runs, crossed


async def _check_alarms(  # noqa: PLR0915 - the comparison reads best in one place
    plan: Plan, fleet: Nodes, conn: asyncpg.Connection, result: FieldResult
) -> None:
    expected = await _model(plan, fleet, conn)
    result.alarms_expected = len(expected)
    rows = await conn.fetch(
        "SELECT a.id, a.device_id, a.rule_key, a.telemetry_event_id, a.status, a.clear_event_id,"
        " a.trigger ->> 'pending_since' AS pending_since,"
        " s.telemetry_event_id AS superseded_by_event,"
        " s.trigger ->> 'pending_since' AS superseded_by_since"
        " FROM alarm a LEFT JOIN alarm s ON s.id = a.superseded_by"
        " WHERE a.rule_key = ANY($1::text[])",
        list(MODEL_RULES),
    )
    runs, since_runs, crossed = _runs(plan, await _judged_order(conn), result)
    received: dict[str, list[datetime]] = {}
    for r in await conn.fetch("SELECT device_id, received_at FROM telemetry"):
        received.setdefault(r["device_id"], []).append(r["received_at"])

    def timer_race(device: str, alarm: dict[str, Any]) -> bool:
        """A hold the model fires at its exact due time, but a sample of the device received
        within a timer interval after it: the gateway's hold timer passes every TIMER_S, so
        that sample may clear the hold before a pass comes round (docs/rules-and-alarms.md,
        "Holds on the clock"). Either outcome keeps the contract."""
        if alarm.get("pending_since") is None:
            return False
        due = datetime.fromisoformat(alarm["sample_ts"])
        early, late = due - timedelta(seconds=TIMER_S / 2), due + timedelta(seconds=2 * TIMER_S)
        return any(early <= at <= late for at in received.get(device, []))

    def report(what: str, device: str, rule: str, detail: str) -> None:
        found = Discrepancy(what, detail)
        if (device, rule) in crossed:
            result.ordering_limits.append(found)
        else:
            result.discrepancies.append(found)

    kinds = {d.device_id: d.kind for d in plan.devices}
    place = {m.event_id: m.index for d in plan.devices for m in d.messages}

    def key_of(device: str, rule: str, event_id: str | None, since: str | None) -> str | None:
        """An alarm's identity for the comparison: its run (threshold rules, steady clocks),
        else the sample that raised it."""
        if event_id is None:
            return None
        if since is not None:
            found = since_runs.get((device, datetime.fromisoformat(since)))
            if found is not None:
                return found
        return runs.get((rule, event_id), event_id)

    def successor(rule: str, alarm_event: str, by: str | None, by_key: str | None) -> str | None:
        """Event rules: which later occurrence superseded an alarm depends on the order they
        were committed in (a late one is slotted in behind the alarm raised since); what must
        hold is that it was a later one of the device (never an earlier one)."""
        if by is None or rule not in EVENT_RULES:
            return by_key
        later = place.get(by, -1) > place.get(alarm_event, -1)
        return "a later occurrence" if later else f"an earlier occurrence {by[:12]}"

    actual: dict[tuple[str, str, str | None], asyncpg.Record] = {}
    for row in rows:
        device, rule = row["device_id"], row["rule_key"]
        key = (device, rule, key_of(device, rule, row["telemetry_event_id"], row["pending_since"]))
        if key in actual:
            report("alarm twice", device, rule, _show(key))
        actual[key] = row
    result.alarms_checked = len(rows)
    model_since = {a["telemetry_event_id"]: a.get("pending_since") for a in expected}
    # Alarms of runs merged into one (see _runs) are one alarm: the last one's outcome.
    collapsed: dict[tuple[str, str, str | None], dict[str, Any]] = {}
    for alarm in expected:
        device, rule = alarm["device_id"], alarm["rule_key"]
        since = alarm.get("pending_since")
        key = (device, rule, key_of(device, rule, alarm["telemetry_event_id"], since))
        collapsed[key] = {**collapsed.get(key, {}), **alarm}
    for key, alarm in collapsed.items():
        device, rule = key[0], key[1]
        row = actual.pop(key, None)
        if row is None:
            detail = f"{_show(key)} (model: {alarm})"
            if timer_race(device, alarm):
                result.timer_races.append(Discrepancy("hold not fired", detail))
            else:
                report("alarm missing", device, rule, detail)
            continue
        if kinds[device] in JUMPY:
            continue
        by = row["superseded_by_event"]
        got = (
            "SUPERSEDED" if row["status"] == "SUPERSEDED" else "OPEN",
            successor(
                rule,
                row["telemetry_event_id"],
                by,
                key_of(device, rule, by, row["superseded_by_since"]),
            ),
            key_of(device, rule, row["clear_event_id"], None),
        )
        by = alarm["superseded_by"]
        want = (
            alarm["status"],
            successor(
                rule,
                alarm["telemetry_event_id"],
                by,
                key_of(device, rule, by, model_since.get(by) if by else None),
            ),
            key_of(device, rule, alarm["clear_event_id"], None),
        )
        if got != want:
            report(
                "alarm differs",
                device,
                rule,
                f"{_show(key)}: status/superseded by/cleared by "
                f"{_short(got)}, model {_short(want)}",
            )
    for key, row in actual.items():
        report("alarm unexpected", key[0], key[1], f"{_show(key)} ({row['status']})")
    await _check_chains(plan, conn, result)
    reclaims = await conn.fetchval("SELECT count(*) FROM alarm WHERE rule_key = 'command-reclaims'")
    if reclaims:
        result.discrepancies.append(
            Discrepancy("outage", f"{reclaims} command-reclaims alarms raised by a broker outage")
        )


async def _check_commands(conn: asyncpg.Connection, result: FieldResult) -> None:
    """Every command of the outage, the campaign's included, was sent once the broker was back.

    Checked last: waiting for a late one must not make the devices look silent to the
    inactivity check."""
    # Waited for: the campaign's pace may leave some of it to dispatch after the settle.
    stuck = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(COMMANDS_SENT_TIMEOUT_S):
            while True:
                stuck = await conn.fetch(
                    "SELECT id, device_id, status, campaign_id FROM command"
                    " WHERE status IN ('PENDING', 'CLAIMED') ORDER BY id"
                )
                if not stuck:
                    break
                await asyncio.sleep(0.2)
    for row in stuck:
        what = "campaign command" if row["campaign_id"] is not None else "command"
        result.discrepancies.append(
            Discrepancy(
                "outage",
                f"{what} {row['id']} to {row['device_id']} still {row['status']} after the outage",
            )
        )


def _show(key: tuple[str, str, str | None]) -> str:
    return f"{key[0]} {key[1]} {(key[2] or '-')[:12]}"


def _short(values: tuple[str | None, ...]) -> str:
    return "/".join((v[:12] if v else "-") for v in values)


async def _check_chains(plan: Plan, conn: asyncpg.Connection, result: FieldResult) -> None:
    """An occurrence is never hidden: an event alarm superseded leads, alarm by alarm, to one
    that is open; each (device, event rule) has exactly one open alarm if it has any."""
    rows = await conn.fetch(
        "SELECT id, device_id, rule_key, status, superseded_by FROM alarm"
        " WHERE rule_key IN ('sos', 'door')"
    )
    by_id = {r["id"]: r for r in rows}
    open_per_slot: dict[tuple[str, str], int] = {}
    for row in rows:
        slot = (row["device_id"], row["rule_key"])
        open_per_slot.setdefault(slot, 0)
        if row["status"] != "SUPERSEDED":
            open_per_slot[slot] += 1
            continue
        seen, current = set(), row
        while current["status"] == "SUPERSEDED":
            if current["id"] in seen or current["superseded_by"] not in by_id:
                result.discrepancies.append(
                    Discrepancy("hidden", f"alarm {row['id']} leads to no open alarm")
                )
                break
            seen.add(current["id"])
            current = by_id[current["superseded_by"]]
    for slot, n in open_per_slot.items():
        if n != 1:
            result.discrepancies.append(
                Discrepancy("open alarms", f"{slot[0]} {slot[1]}: {n} open, expected 1")
            )


async def _check_inactivity(plan: Plan, conn: asyncpg.Connection, result: FieldResult) -> None:
    """Each silent device alarmed once, no other. Silence counts only while a node listens
    (after a broker outage, the outage is not silence), so the alarms may come up to the
    silence plus the outage after the device stopped: waited for, within that bound."""
    silent = [d.device_id for d in plan.devices if d.kind == "silent"]
    bound = silent_seconds(plan.duration_s) + 2 * outage_seconds(plan.duration_s) + 15
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(bound):
            while True:
                alarmed = await conn.fetchval(
                    "SELECT count(DISTINCT device_id) FROM alarm"
                    " WHERE rule_key = 'silent' AND device_id = ANY($1::text[])",
                    silent,
                )
                if alarmed >= len(silent):
                    break
                await asyncio.sleep(0.5)
    # A device that talked to the end of the plan falls silent then too: while the checks run
    # (slow on a loaded machine) its silence may reach the rule's, and that alarm is right.
    # What must never be is an alarm sooner than the silence after the device's last message.
    rows = await conn.fetch(
        "SELECT a.device_id, a.created_at < last.received_at + make_interval(secs => $1)"
        " AS early FROM alarm a"
        " LEFT JOIN (SELECT device_id, max(received_at) AS received_at FROM telemetry"
        " GROUP BY device_id) last USING (device_id)"
        " WHERE a.rule_key = 'silent'",
        silent_seconds(plan.duration_s),
    )
    per_device: dict[str, int] = {}
    after_the_end: dict[str, int] = {}
    for row in rows:
        device_id = row["device_id"]
        if row["early"] is False and device_id not in silent:
            after_the_end[device_id] = after_the_end.get(device_id, 0) + 1
        else:
            per_device[device_id] = per_device.get(device_id, 0) + 1
    result.silent_after_end += sum(after_the_end.values())
    for device in plan.devices:
        n = per_device.pop(device.device_id, 0)
        want = 1 if device.kind == "silent" else 0
        if n != want:
            result.discrepancies.append(
                Discrepancy("inactivity", f"{device.device_id}: {n} alarms, expected {want}")
            )
    for device_id, n in per_device.items():
        result.discrepancies.append(Discrepancy("inactivity", f"{device_id}: {n} unexpected"))


async def _check_reach(conn: asyncpg.Connection, hook: Webhook, result: FieldResult) -> None:
    """Every CRITICAL alarm raised open reached the webhook; nothing is left NEW or DELAYED."""
    critical = {
        r["id"]
        for r in await conn.fetch(
            "SELECT a.id FROM alarm a JOIN alarm_audit c ON c.alarm_id = a.id"
            " AND c.action = 'create' AND c.to_status <> 'SUPERSEDED'"
            " WHERE a.severity = 'CRITICAL'"
        )
    }
    try:
        async with asyncio.timeout(60):
            while True:
                waiting = await conn.fetchval(
                    "SELECT count(*) FROM alarm WHERE status IN ('NEW', 'DELAYED')"
                )
                if not waiting and critical <= hook.alarm_ids(EventType.ALARM_CREATED):
                    return
                await asyncio.sleep(0.5)
    except TimeoutError:
        pass
    missed = critical - hook.alarm_ids(EventType.ALARM_CREATED)
    if missed:
        result.discrepancies.append(
            Discrepancy("reach", f"CRITICAL alarms never at the webhook: {sorted(missed)}")
        )
    for row in await conn.fetch(
        "SELECT id, device_id, rule_key, status FROM alarm WHERE status IN ('NEW', 'DELAYED')"
    ):
        result.discrepancies.append(
            Discrepancy(
                "stuck", f"alarm {row['id']} {row['device_id']} {row['rule_key']} {row['status']}"
            )
        )


def render(result: FieldResult) -> str:
    lines = [
        f"seed {result.seed}: {result.nodes} nodes, {result.devices} devices, "
        f"{result.messages} messages ({result.duplicates} sent twice), "
        f"faults {', '.join(result.faults)}",
        f"alarms: {result.alarms_checked} stored, {result.alarms_expected} expected by the model "
        f"({result.merged_runs} runs merged by late samples, {len(result.ordering_limits)} "
        "differences where samples were committed out of order across runs); "
        f"{len(result.discrepancies)} discrepancies ({result.seconds:.0f} s)",
    ]
    lines += [f"  {d}" for d in result.discrepancies[:40]]
    lines += [f"  (ordering limit) {d}" for d in result.ordering_limits[:10]]
    lines += [f"  (timer race) {d}" for d in result.timer_races[:10]]
    if not result.ok:
        lines.append(f"replay: {result.replay}")
    return "\n".join(lines)


def plan_summary(seed: int, *, minutes: float, nodes: int, devices: int) -> str:
    return "\n".join(describe(make_plan(seed, minutes=minutes, nodes=nodes, devices=devices)))
