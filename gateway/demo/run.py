"""``gateway demo``: the whole product on this machine in one command, for a first look.

The zero-setup daemon (embedded PostgreSQL and MQTT broker, as ``gateway run`` without a
configuration); rules written as an alarm philosophy would have them (see `RULES`); about a
hundred simulated devices with the ``gateway-sim devices`` patterns (``demo-00000`` …:
temperature walks with rare excursions, doors, SOS and smoke buttons, leaks, power cuts, one
device that goes silent) answering downlink commands; hubs with presence (birth and Will, one of
them losing its connection now and then) and a chattering fan (gateway/demo/devices.py); one
device out of service (`OUT_OF_SERVICE_DEVICE`: its alarms shown, never notified); a webhook
receiver of its own that the notification routes deliver to (gateway/demo/webhook.py); and an
admin token made up for the occasion.

It prints two lines: the console's address and the token, then its state directory and the
``gateway.toml`` it wrote there, which every other command reads with ``--config`` (``gateway
dead-letters list --config …``, ``gateway-sim publish --config …``). Ctrl-C (or SIGTERM, or a
hang-up) stops the devices, then the daemon, which stops its broker and its PostgreSQL; the state
directory is a temporary one, removed at the end, unless ``--state-dir`` names one. A start that
cannot succeed as asked (a port taken, a state directory that cannot be one) is a `DemoError`: one
line naming the demo's flag, with nothing left behind.

``--screenshots OUTDIR`` runs the same demo until it has open alarms, photographs the console
(the alarm list and an alarm's detail, at 1280x800 and 390x844) with Debian's chromium driven
by Playwright, and stops. ``--measure-live N`` times N alarms from their telemetry to an open
console page.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.util
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import aiohttp
import aiomqtt
import structlog

from gateway.config import Config, parse_config
from gateway.demo.devices import DemoDevices
from gateway.demo.sparkplug_edge import GROUP as SPARKPLUG_GROUP
from gateway.demo.sparkplug_edge import NODE as SPARKPLUG_NODE
from gateway.demo.webhook import WebhookReceiver
from gateway.domain.errors import StartupError
from gateway.runtime.components import node_metrics
from gateway.runtime.daemon import Daemon
from gateway.runtime.logging import configure_logging
from protocol import Telemetry, encode_telemetry
from sim.devices import DeviceFleet, FleetConfig
from sim.patterns import PatternParams, parse_mix
from sim.responder import Script

log = structlog.get_logger(__name__)

DEMO_DEVICES: Final = 100
DEVICE_PREFIX: Final = "demo"
# Messages per second over the fleet: each device speaks about every two seconds.
DEMO_RATE: Final = 50.0
# One silent device in a hundred; the rest as `gateway-sim devices` mixes them.
DEMO_MIX: Final = "walk=76,door=10,sos=3,smoke=3,water_leak=4,power=3,silent=1"
DEMO_SILENT_S: Final = 30
TOKEN_NAME: Final = "demo-admin"  # noqa: S105 - the token's name, not a secret
RECEIVER_NAME: Final = "demo-webhook"
# A device under maintenance: its alarms are still raised and shown, never notified (a power
# device: its mains is being worked on). Put out of service through the API, as an operator.
OUT_OF_SERVICE_DEVICE: Final = "demo-00020"
OUT_OF_SERVICE_REASON: Final = "demo: an electrician is working on its supply"
SPARKPLUG_HOST_ID: Final = "gateway-demo"
CONFIG_FILE: Final = "gateway.toml"
READY_TIMEOUT_S: Final = 120.0
# How long the fleet waits for the hand-made devices' subscriptions (then starts anyway).
SUBSCRIBED_TIMEOUT_S: Final = 30.0
CHROMIUM: Final = Path("/usr/bin/chromium")
SCREEN_SIZES: Final = {"desktop": (1280, 800), "phone": (390, 844)}

# The alarm philosophy of the demo (ISA-18.2, EEMUA 191): every alarm asks a person to do
# something, its severity says how soon, and noise never reaches the list. A temperature blip of
# a sample or two is noise (`for_samples`), a value must fall well back before the rule re-arms
# (`clear_value`), a door opening is an event worth storing but not an alarm (no rule), and
# CRITICAL is kept for people in danger. The Sparkplug oven and the Tasmota room sensor have a
# rule each on their own metric names, with the same persistence and deadband; neither fires
# unless someone drives the process there (a `Setpoint` above 250 °C written to the oven).
# `fan-vibration` is the exception on purpose: its deadband is too narrow, so it chatters, and
# the alarm figures name it a bad actor; its notifications are muted by the first route until
# someone fixes the rule.
RULES: Final = f"""
[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
for_samples = 4
severity = "MAJOR"
description = "Above 80 °C for four readings in a row (about 8 s), not a one-sample blip: \
check the cooling. Re-arms below 75 °C."

[[rules]]
key = "sos"
kind = "event"
event = "SOS"
severity = "CRITICAL"
description = "Someone pressed the SOS button: call them back now."

[[rules]]
key = "smoke"
kind = "event"
event = "SMOKE"
severity = "CRITICAL"
description = "Smoke detected: check the room, call the fire service if confirmed."

[[rules]]
key = "water-leak"
kind = "event"
event = "WATER_LEAK"
severity = "MAJOR"
description = "Water on the floor sensor: send someone to stop the leak."

[[rules]]
key = "power-off"
kind = "event"
event = "POWER_OFF"
severity = "WARNING"
description = "Mains power lost; the device runs on battery: check the supply within the hour."

[[rules]]
key = "silent"
kind = "inactivity"
silent_seconds = {DEMO_SILENT_S}
severity = "WARNING"
devices = ["{DEVICE_PREFIX}-*", "tasmota-*", "{SPARKPLUG_GROUP}/{SPARKPLUG_NODE}/*"]
description = "The device has said nothing for {DEMO_SILENT_S} s, or went offline (its Will, \
a Tasmota LWT, a Sparkplug NDEATH or DDEATH): check its power and network."

[[rules]]
key = "oven-overheat"
kind = "threshold"
metric = "Temperature"
op = ">"
value = 250
clear_value = 240
for_samples = 3
severity = "MAJOR"
devices = "{SPARKPLUG_GROUP}/{SPARKPLUG_NODE}/Oven"
description = "The oven (a Sparkplug device) is above 250 °C for three readings: the product \
burns. Check its Setpoint and the burner. Re-arms below 240 °C."

[[rules]]
key = "room-warm"
kind = "threshold"
metric = "AM2301.Temperature"
op = ">"
value = 30
clear_value = 28
for_samples = 3
severity = "WARNING"
devices = "tasmota-climate-*"
description = "The server room (a Tasmota sensor) is above 30 °C for three readings (30 s): \
check its air conditioning before the equipment suffers. Re-arms below 28 °C."

[[rules]]
key = "fan-vibration"
kind = "threshold"
metric = "vibration"
op = ">"
value = 7.0
clear_value = 6.95
severity = "WARNING"
devices = "demo-fan-*"
description = "Fan vibration above 7 mm/s. (A badly tuned rule on purpose: its deadband is \
too narrow, so it chatters.)"
"""


@dataclass(frozen=True)
class DemoSettings:
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    mqtt_port: int = 1883
    """0: a free port, found before the start (the embedded broker needs a number)."""
    state_dir: Path | None = None
    devices: int = DEMO_DEVICES
    rate: float = DEMO_RATE


class DemoError(Exception):
    """The demo cannot start as asked: one line, naming the demo's flag that changes it when
    one can (``configuration``: the command exits 2, else 1)."""

    def __init__(self, message: str, *, configuration: bool = True) -> None:
        super().__init__(message)
        self.configuration = configuration


def demo_config_text(settings: DemoSettings, state_dir: Path, webhook_url: str) -> str:
    """The configuration every ``gateway`` command can read (``--config``): the demo's state
    directory, broker and console ports, rules and notifications; no API token."""
    return f"""# Written by `gateway demo`: the other commands find the demo with --config this file
# (gateway dead-letters list --config ..., gateway-sim publish --config ...).
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

# The demo's Sparkplug B edge node (group {SPARKPLUG_GROUP}): its devices are
# {SPARKPLUG_GROUP}/{SPARKPLUG_NODE}/Oven and {SPARKPLUG_GROUP}/{SPARKPLUG_NODE}/Pump.
[sparkplug]
enabled = true
host_id = "{SPARKPLUG_HOST_ID}"
groups = ["{SPARKPLUG_GROUP}"]

# The demo's Tasmota devices, on Tasmota's own topics (tele/{{device}}/SENSOR, its LWT,
# cmnd/{{device}}/POWER).
[[ingest.mappings]]
name = "tasmota"
profile = "tasmota"

# The demo's own webhook receiver (gateway/demo/webhook.py): its deliveries show in the
# console's Notifications page.
[[notify.receivers]]
name = "{RECEIVER_NAME}"
kind = "webhook"
url = "{webhook_url}"

# The chattering rule is muted until it is fixed (its notifications would page all day).
[[notify.routes]]
rules = ["fan-vibration"]
receivers = []

[[notify.routes]]
events = ["alarm.created", "alarm.escalated"]
receivers = ["{RECEIVER_NAME}"]
{RULES}"""


def demo_config(settings: DemoSettings, state_dir: Path, token: str, webhook_url: str) -> Config:
    """The daemon's configuration: the file's, and one admin token."""
    return parse_config(
        demo_config_text(settings, state_dir, webhook_url)
        + f"""
[[api.tokens]]
name = "{TOKEN_NAME}"
token = "{token}"
role = "admin"
"""
    )


def fleet_config(settings: DemoSettings, broker: tuple[str, int]) -> FleetConfig:
    host, port = broker
    return FleetConfig(
        host=host,
        port=port,
        protocol="3.1.1",  # the embedded broker speaks 3.1.1
        devices=settings.devices,
        rate=settings.rate,
        mix=parse_mix(DEMO_MIX),
        device_prefix=DEVICE_PREFIX,
        # Rare enough that the list stays calm (a few alarms a minute over the fleet): a
        # temperature excursion of 1 to 6 samples, of which those of 4 or more fire
        # `temp-high`; an event now and then; the silent device quiet for long enough to
        # raise its alarm, then back.
        params=PatternParams(
            crossing_probability=0.001,
            spike_samples=(1, 6),
            event_probability=0.002,
            active_messages=15,
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
    state_dir: Path
    config_path: Path
    webhook: WebhookReceiver


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def check_settings(settings: DemoSettings) -> DemoSettings:
    """Ports in range and free, the state directory usable; a `DemoError` names the flag.
    ``--mqtt-port 0`` becomes a free port here."""
    for flag, port in (("--http-port", settings.http_port), ("--mqtt-port", settings.mqtt_port)):
        if not 0 <= port <= 65535:
            raise DemoError(f"{flag} {port} is not a port: 1 to 65535, or 0 for any free port")
    for flag, port in (("--http-port", settings.http_port), ("--mqtt-port", settings.mqtt_port)):
        if port:
            _check_port_free(
                flag, settings.http_host if flag == "--http-port" else "127.0.0.1", port
            )
    if (
        settings.state_dir is not None
        and settings.state_dir.exists()
        and not settings.state_dir.is_dir()
    ):
        raise DemoError(f"--state-dir {settings.state_dir} is not a directory")
    if settings.mqtt_port == 0:
        settings = replace(settings, mqtt_port=_free_port("127.0.0.1"))
    return settings


def _check_port_free(flag: str, host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As asyncio.start_server binds: the probe fails exactly when the server would.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise DemoError(
                    f"port {port} on {host} is already in use: choose another with "
                    f"{flag} PORT, or {flag} 0 for any free port"
                ) from None
            raise DemoError(
                f"cannot listen on {host}:{port} ({exc.strerror}): change {flag}"
            ) from None


def _flag_of(exc: StartupError) -> str:
    """The demo's flag for the daemon's setting: the demo has no configuration file."""
    if exc.setting.startswith("[http]"):
        return "--http-port PORT (0: any free port)"
    if exc.setting.startswith("[mqtt]"):
        return "--mqtt-port PORT (0: any free port)"
    if exc.setting.startswith("[node] state_dir"):
        return "--state-dir DIR"
    return ""


@contextlib.asynccontextmanager
async def running_demo(settings: DemoSettings, stop: asyncio.Event) -> AsyncIterator[Demo]:
    """The daemon, the fleet, the hand-made devices and the webhook receiver running; all
    stopped, and a temporary state directory removed, on exit. Raises `DemoError` (one line,
    naming the demo's flag) when it cannot start as asked."""
    settings = check_settings(settings)
    token = secrets.token_urlsafe(24)
    own_state = settings.state_dir is None
    state_dir = Path(tempfile.mkdtemp(prefix="gateway-demo-")) if own_state else settings.state_dir
    assert state_dir is not None
    try:
        async with WebhookReceiver() as webhook:
            try:
                state_dir.mkdir(parents=True, exist_ok=True)
                config_path = state_dir / CONFIG_FILE
                config_path.write_text(demo_config_text(settings, state_dir, webhook.url))
            except OSError as exc:
                raise DemoError(
                    f"cannot write to --state-dir {state_dir}: {exc.strerror}"
                ) from None
            config = demo_config(settings, state_dir, token, webhook.url)
            daemon = Daemon(config, metrics=node_metrics(), config_path=config_path)
            async with _daemon_running(daemon, stop):
                assert daemon.broker_address is not None
                wildcard = settings.http_host in ("0.0.0.0", "::")  # noqa: S104 - compared, not bound
                host = "127.0.0.1" if wildcard else settings.http_host
                url = f"http://{host}:{daemon.http_port}/"
                async with (
                    _devices_running(settings, daemon.broker_address, config),
                    _in_background(_put_out_of_service(url, token)),
                ):
                    yield Demo(
                        url=url,
                        token=token,
                        daemon=daemon,
                        state_dir=state_dir,
                        config_path=config_path,
                        webhook=webhook,
                    )
    finally:
        if own_state:
            shutil.rmtree(state_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def _in_background(work: Awaitable[None]) -> AsyncIterator[None]:
    task = asyncio.ensure_future(work)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _put_out_of_service(url: str, token: str) -> None:
    """`OUT_OF_SERVICE_DEVICE` out of service as soon as the gateway knows it (its first
    message; the API answers 404 before), through the API as an operator would."""
    target = f"{url}devices/{OUT_OF_SERVICE_DEVICE}/out-of-service"
    headers = {"Authorization": f"Bearer {token}"}
    body = {"reason": OUT_OF_SERVICE_REASON}
    deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_S
    async with aiohttp.ClientSession(headers=headers) as http:
        while True:
            async with http.put(target, json=body) as answer:
                if answer.status == 200:
                    log.info("demo_device_out_of_service", device_id=OUT_OF_SERVICE_DEVICE)
                    return
                if answer.status != 404 or asyncio.get_running_loop().time() > deadline:
                    log.warning("demo_out_of_service_refused", status=answer.status,
                                answer=(await answer.text())[:200])  # fmt: skip
                    return
            await asyncio.sleep(0.5)  # polls for the device's first message, with a deadline


@contextlib.asynccontextmanager
async def _daemon_running(daemon: Daemon, stop: asyncio.Event) -> AsyncIterator[None]:
    daemon_stop = asyncio.Event()
    daemon_task = asyncio.create_task(daemon.run(daemon_stop), name="demo-daemon")
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
            try:
                daemon_task.result()  # its error, if it failed
            except StartupError as exc:
                flag = _flag_of(exc)
                raise DemoError(
                    f"{exc}{': change ' + flag if flag else ''}",
                    configuration=bool(flag) or exc.configuration,
                ) from None
            raise RuntimeError("the daemon stopped before it was ready")
        if not done:
            raise RuntimeError(f"the daemon was not ready within {READY_TIMEOUT_S:g} s")
        if daemon.broker_address is None or daemon.http_port is None:
            raise RuntimeError("the daemon is ready without a broker or an HTTP port")
        yield
    finally:
        daemon_stop.set()
        with contextlib.suppress(StartupError):  # raised above as a DemoError
            await daemon_task


@contextlib.asynccontextmanager
async def _devices_running(
    settings: DemoSettings, broker: tuple[str, int], config: Config
) -> AsyncIterator[None]:
    """The simulated fleet and the hand-made devices; stopped (and awaited) on exit. The
    hand-made devices that subscribe do so before the fleet connects (see `DemoDevices.run`:
    the embedded broker drops a connection made while another client subscribes)."""
    devices_stop = asyncio.Event()
    fleet = DeviceFleet(fleet_config(settings, broker))
    own = DemoDevices(host=broker[0], port=broker[1], topics=config.topics)
    own_subscribed = asyncio.Event()
    tasks: list[asyncio.Task[object]] = [
        asyncio.create_task(own.run(devices_stop, own_subscribed), name="demo-devices"),
    ]
    tasks[0].add_done_callback(_report_fleet_end)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(own_subscribed.wait(), timeout=SUBSCRIBED_TIMEOUT_S)
        tasks.append(asyncio.create_task(fleet.run(devices_stop), name="demo-fleet"))
        tasks[-1].add_done_callback(_report_fleet_end)
        yield
    finally:
        devices_stop.set()
        for task in tasks:
            with contextlib.suppress(Exception):  # reported when it happened
                await task


def _report_fleet_end(task: asyncio.Task[object]) -> None:
    """The devices stopping on their own (not at Ctrl-C) is said at once, with why."""
    if not task.cancelled() and task.exception() is not None:
        log.error("demo_devices_failed", error=repr(task.exception()))


def _stop_on_signals(stop: asyncio.Event) -> None:
    """Ctrl-C, SIGTERM and a hang-up (the terminal closed, the SSH session dropped) stop
    everything the demo started. (A hang-up's default action ended the process on the spot:
    its PostgreSQL, in a session of its own, stayed running, its state directory too.)"""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
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
        kept = "" if settings.state_dir is not None else ", removed at the end"
        print(
            f"State directory: {demo.state_dir}{kept}; the other commands find the demo with "
            f"--config {demo.config_path} (gateway dead-letters list --config ..., "
            "gateway-sim publish --config ...)",
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


# How many connections a latency spike may take (the embedded broker drops some: `spike`).
SPIKE_ATTEMPTS: Final = 3


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

        async def spike(device: str) -> None:
            # One message that raises an alarm (`water-leak`; `temp-high` needs four), on a
            # connection of its own, made again if the broker drops it: the embedded broker
            # (amqtt 0.12) drops a connection whose CONNECT it handles while another client
            # subscribes (see `DemoDevices.run`), and the fleet's devices subscribe whenever
            # they reconnect. The same message again is the same reading (its id is its time
            # and content): a publish sent twice raises one alarm.
            leak = Telemetry(ts=datetime.now(UTC), events=[{"type": "WATER_LEAK"}])
            for attempt in range(1, SPIKE_ATTEMPTS + 1):
                try:
                    async with aiomqtt.Client(
                        host, port, identifier="gateway-demo-latency"
                    ) as client:
                        await client.publish(
                            topics.telemetry(device), encode_telemetry(leak), qos=1
                        )
                except aiomqtt.MqttError:
                    if attempt == SPIKE_ATTEMPTS:
                        raise
                else:
                    return

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
