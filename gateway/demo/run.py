"""``gateway demo``: the whole product on this machine in one command, for a first look.

The zero-setup daemon (embedded PostgreSQL and MQTT broker, as ``gateway run`` without a
configuration), a handful of example rules, about a hundred simulated devices with the
``gateway-sim devices`` patterns (temperature walks that spike, doors, SOS and smoke buttons,
leaks, power cuts, one device that goes silent) answering downlink commands, and an admin token
made up for the occasion. It prints one line: the console's address and the token. Ctrl-C
(or SIGTERM) stops the devices, then the daemon, which stops its broker and its PostgreSQL;
the state directory is a temporary one, removed at the end, unless ``--state-dir`` names one.

``--screenshots OUTDIR`` runs the same demo until it has open alarms, photographs the console
(the alarm list and an alarm's detail, at 1280x800 and 390x844) with Debian's chromium driven
by Playwright, and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import aiomqtt
import structlog

from gateway.config import Config, parse_config
from gateway.runtime.components import node_metrics
from gateway.runtime.daemon import Daemon
from gateway.runtime.logging import configure_logging
from protocol import Telemetry, encode_telemetry
from sim.devices import DeviceFleet, FleetConfig
from sim.patterns import PatternParams, parse_mix
from sim.responder import Script

log = structlog.get_logger(__name__)

DEMO_DEVICES: Final = 100
# Messages per second over the fleet: each device speaks about every two seconds.
DEMO_RATE: Final = 50.0
# One silent device in a hundred; the rest as `gateway-sim devices` mixes them.
DEMO_MIX: Final = "walk=70,door=10,sos=5,smoke=5,water_leak=5,power=4,silent=1"
DEMO_SILENT_S: Final = 20
TOKEN_NAME: Final = "demo-admin"  # noqa: S105 - the token's name, not a secret
READY_TIMEOUT_S: Final = 120.0
CHROMIUM: Final = Path("/usr/bin/chromium")
SCREEN_SIZES: Final = {"desktop": (1280, 800), "phone": (390, 844)}

RULES: Final = f"""
[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
severity = "CRITICAL"
description = "Temperature above 80 °C: check the cooling; clears below 75 °C."

[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
description = "A door opened; clears when it closes."

[[rules]]
key = "sos"
kind = "event"
event = "SOS"
severity = "CRITICAL"
description = "Someone pressed the SOS button: call them back."

[[rules]]
key = "smoke"
kind = "event"
event = "SMOKE"
severity = "CRITICAL"
description = "Smoke detected."

[[rules]]
key = "water-leak"
kind = "event"
event = "WATER_LEAK"
severity = "MAJOR"
description = "Water on the floor sensor."

[[rules]]
key = "power-off"
kind = "event"
event = "POWER_OFF"
severity = "WARNING"
description = "Mains power lost; the device runs on battery."

[[rules]]
key = "silent"
kind = "inactivity"
silent_seconds = {DEMO_SILENT_S}
severity = "WARNING"
description = "The device has said nothing for {DEMO_SILENT_S} s."
"""


@dataclass(frozen=True)
class DemoSettings:
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    mqtt_port: int = 1883
    state_dir: Path | None = None
    devices: int = DEMO_DEVICES
    rate: float = DEMO_RATE


def demo_config(settings: DemoSettings, state_dir: Path, token: str) -> Config:
    """The daemon's configuration: embedded everything, the example rules, one admin token."""
    return parse_config(f"""
[node]
id = "demo"
state_dir = "{state_dir}"

[mqtt]
port = {settings.mqtt_port}

[http]
host = "{settings.http_host}"
port = {settings.http_port}

[log]
level = "warning"

[alarms]
timer_interval_s = 1

[commands]
reaper_interval_s = 1

[[api.tokens]]
name = "{TOKEN_NAME}"
token = "{token}"
role = "admin"
{RULES}""")


def fleet_config(settings: DemoSettings, broker: tuple[str, int]) -> FleetConfig:
    host, port = broker
    return FleetConfig(
        host=host,
        port=port,
        protocol="3.1.1",  # the embedded broker speaks 3.1.1
        devices=settings.devices,
        rate=settings.rate,
        mix=parse_mix(DEMO_MIX),
        # Spikes and events often enough that alarms come within seconds; the silent device
        # goes quiet after a few messages and stays so long enough to raise its alarm.
        params=PatternParams(
            crossing_probability=0.02,
            event_probability=0.05,
            active_messages=5,
            silence_s=3 * DEMO_SILENT_S,
        ),
        client_id="gateway-demo-devices",
        script=Script(),
    )


@dataclass(frozen=True)
class Demo:
    url: str
    token: str
    daemon: Daemon


@contextlib.asynccontextmanager
async def running_demo(settings: DemoSettings, stop: asyncio.Event) -> AsyncIterator[Demo]:
    """The daemon and the fleet running; both stopped, and the state removed, on exit."""
    own_state = settings.state_dir is None
    state_dir = Path(tempfile.mkdtemp(prefix="gateway-demo-")) if own_state else settings.state_dir
    assert state_dir is not None
    token = secrets.token_urlsafe(24)
    daemon = Daemon(demo_config(settings, state_dir, token), metrics=node_metrics())
    daemon_stop = asyncio.Event()
    fleet_stop = asyncio.Event()
    daemon_task = asyncio.create_task(daemon.run(daemon_stop), name="demo-daemon")
    fleet_task: asyncio.Task[object] | None = None
    try:
        ready = asyncio.create_task(daemon.ready.wait())
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait(
            {daemon_task, ready, stopped},
            timeout=READY_TIMEOUT_S,
            return_when=asyncio.FIRST_COMPLETED,
        )
        ready.cancel()
        stopped.cancel()
        if daemon_task in done:
            daemon_task.result()  # its error, if it failed
            raise RuntimeError("the daemon stopped before it was ready")
        if not done:
            raise RuntimeError(f"the daemon was not ready within {READY_TIMEOUT_S:g} s")
        if daemon.broker_address is None or daemon.http_port is None:
            raise RuntimeError("the daemon is ready without a broker or an HTTP port")
        fleet = DeviceFleet(fleet_config(settings, daemon.broker_address))
        fleet_task = asyncio.create_task(fleet.run(fleet_stop), name="demo-fleet")
        fleet_task.add_done_callback(_report_fleet_end)
        host = settings.http_host if settings.http_host not in ("0.0.0.0", "::") else "127.0.0.1"  # noqa: S104 - compared, not bound
        yield Demo(url=f"http://{host}:{daemon.http_port}/", token=token, daemon=daemon)
    finally:
        fleet_stop.set()
        if fleet_task is not None:
            with contextlib.suppress(Exception):  # reported when it happened
                await fleet_task
        daemon_stop.set()
        try:
            await daemon_task
        finally:
            if own_state:
                shutil.rmtree(state_dir, ignore_errors=True)


def _report_fleet_end(task: asyncio.Task[object]) -> None:
    """The devices stopping on their own (not at Ctrl-C) is said at once, with why."""
    if not task.cancelled() and task.exception() is not None:
        log.error("demo_devices_failed", error=repr(task.exception()))


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)


async def run_demo(settings: DemoSettings) -> int:
    """Run until Ctrl-C; print the one line a person needs."""
    configure_logging(node_id="demo", fmt="console", level="warning")
    stop = asyncio.Event()
    _stop_on_signals(stop)
    async with running_demo(settings, stop) as demo:
        print(
            f"Gateway demo: open {demo.url} and sign in with the token {demo.token} "
            "(Ctrl-C stops everything)",
            flush=True,
        )
        await stop.wait()
    return 0


def _browser_missing(option: str) -> bool:
    """Whether ``option`` cannot run here (said on stderr): it needs Playwright, a dev
    dependency, and Debian's chromium."""
    if importlib.util.find_spec("playwright") is None:  # pragma: no cover - in the dev extra
        print(f"{option} needs Playwright (pip install playwright)", file=sys.stderr)
        return True
    if not CHROMIUM.exists():
        print(f"{option} needs Debian's chromium at {CHROMIUM}", file=sys.stderr)
        return True
    return False


async def _with_browser(
    settings: DemoSettings, option: str, work: Callable[[Demo], Awaitable[None]]
) -> int:
    """The demo running while ``work`` uses it with a browser, then stopped; 1 when ``option``
    cannot run here."""
    configure_logging(node_id="demo", fmt="console", level="warning")
    if _browser_missing(option):
        return 1
    stop = asyncio.Event()
    _stop_on_signals(stop)
    async with running_demo(settings, stop) as demo:
        await work(demo)
    return 0


async def run_screenshots(settings: DemoSettings, outdir: Path) -> int:
    """The demo until it has open alarms, the console photographed, then stopped."""
    written: list[Path] = []

    async def photograph(demo: Demo) -> None:
        from gateway.demo.screenshots import take_screenshots  # imports playwright

        written.extend(await take_screenshots(demo.url, demo.token, outdir, CHROMIUM, SCREEN_SIZES))

    code = await _with_browser(settings, "--screenshots", photograph)
    for path in written:
        print(path)
    return code


async def run_measure_live(settings: DemoSettings, count: int) -> int:
    """The demo, an open console, and ``count`` alarms timed from their telemetry to their row
    on the page (one device each, one after the other, among the fleet's own traffic)."""
    millis: list[float] = []

    async def measure(demo: Demo) -> None:
        from gateway.demo.screenshots import measure_live_alarms  # imports playwright

        assert demo.daemon.broker_address is not None
        host, port = demo.daemon.broker_address
        topics = demo.daemon.config.topics
        devices = [f"latency-{n:03d}" for n in range(count)]
        async with aiomqtt.Client(host, port, identifier="gateway-demo-latency") as client:

            async def spike(device: str) -> None:
                hot = Telemetry(ts=datetime.now(UTC), metrics={"temp": 95.0})
                await client.publish(topics.telemetry(device), encode_telemetry(hot), qos=1)

            millis.extend(await measure_live_alarms(demo.url, demo.token, CHROMIUM, devices, spike))

    code = await _with_browser(settings, "--measure-live", measure)
    if code:
        return code
    ordered = sorted(millis)
    print(
        f"{count} alarms, telemetry to the open page: "
        f"p50 {ordered[(len(ordered) - 1) // 2]:.0f} ms, max {ordered[-1]:.0f} ms",
        flush=True,
    )
    return 0
