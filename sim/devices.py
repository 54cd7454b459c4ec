"""A fleet of simulated devices on one MQTT connection, at a target total rate.

Devices take turns round robin; turn ``n`` is due ``n / rate`` seconds after the start, so each
of N devices sends every ``N / rate`` seconds, and a silent device simply lets its turn pass.
Publishes are QoS 1 with at most ``window`` awaiting their PUBACK: when the broker cannot keep
up, the next turn waits for a free slot, the schedule falls behind, and turns more than a
second late are dropped (counted) instead of being sent in a burst later. The achieved rate
says what the broker took.

Commands are answered by a `Responder` on its own connection. The publishing connection is
re-established after a broker loss with capped, jittered backoff; each loss counts as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, TextIO

import aiomqtt
import structlog

from protocol import Encoding, Topics, encode_telemetry
from sim.patterns import (
    DEFAULT_MIX,
    Mix,
    Pattern,
    PatternParams,
    SimDevice,
    check_device_count,
    fleet,
    mix_summary,
    parse_mix,
)
from sim.responder import Responder, Script, reconnect_delay_s
from sim.telemetry import device_ids

log = structlog.get_logger("sim.devices")

SUBSCRIBE_WAIT_S: Final = 10.0
PROGRESS_INTERVAL_S: Final = 1.0
# Yield to the event loop (responder, progress, PUBACKs) at least this often in a burst.
_TURNS_PER_YIELD: Final = 256


class BrokerUnavailableError(Exception):
    """The first connection to the broker failed: nothing was simulated."""

    def __init__(self, host: str, port: int, protocol: str, detail: str, *, refused: bool) -> None:
        hint = ""
        if refused and protocol == "5":
            hint = (
                "; the gateway's embedded broker (amqtt) speaks MQTT 3.1.1 only: "
                "try --protocol 3.1.1"
            )
        super().__init__(
            f"cannot connect to the broker at {host}:{port} (MQTT {protocol}): {detail}{hint}"
        )
        self.host = host
        self.port = port
        self.protocol = protocol


@dataclass
class Pacer:
    """Turns at ``rate`` per second from ``start_s``: turn ``n`` is due at ``start_s + n / rate``.

    Pure: the caller passes the time. ``max_lag`` bounds how far behind the schedule may fall;
    older turns are dropped and counted in ``dropped``.
    """

    rate: float
    start_s: float
    max_lag: int
    taken: int = 0
    dropped: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a number of messages per second > 0, got {self.rate}")
        if self.max_lag < 1:
            raise ValueError(f"max_lag must be at least 1, got {self.max_lag}")

    def due(self, now_s: float) -> int:
        """How many turns are due at ``now_s`` and not yet taken; they count as taken now."""
        if now_s < self.start_s:
            return 0
        # The epsilon absorbs float error: at exactly `next_due_s()` that turn is due.
        target = math.floor((now_s - self.start_s) * self.rate + 1e-9) + 1
        behind = target - self.taken
        if behind <= 0:
            return 0
        if behind > self.max_lag:
            self.dropped += behind - self.max_lag
            behind = self.max_lag
        self.taken = target
        return behind

    def untake(self, turns: int) -> None:
        """Give back ``turns`` of the last `due` that were not used: they are due again."""
        self.taken -= turns

    def next_due_s(self) -> float:
        """When the next untaken turn is due."""
        return self.start_s + self.taken / self.rate


def default_max_lag(rate: float) -> int:
    """One second of turns: a broker hiccup is caught up, a slow broker lowers the rate."""
    return max(1, math.ceil(rate))


@dataclass(frozen=True)
class FleetConfig:
    host: str = "127.0.0.1"
    port: int = 1883
    prefix: str = "iot"
    devices: int = 100
    rate: float = 100.0
    """Messages per second, over all devices together."""
    duration_s: float | None = None
    messages: int | None = None
    seed: int = 1
    mix: Mix = field(default_factory=lambda: parse_mix(DEFAULT_MIX))
    params: PatternParams = field(default_factory=PatternParams)
    protocol: Literal["3.1.1", "5"] = "5"
    encoding: Encoding = Encoding.JSON
    client_id: str = "gateway-sim-devices"
    script: Script | None = field(default_factory=Script)
    """How commands are answered; None: not at all (no responder connection)."""
    window: int = 256
    publish_timeout_s: float = 10.0
    device_prefix: str = "sim"

    def __post_init__(self) -> None:
        check_device_count(self.devices)
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a number of messages per second > 0, got {self.rate}")
        if self.duration_s is not None and not (
            math.isfinite(self.duration_s) and self.duration_s > 0
        ):
            raise ValueError(f"duration must be a number of seconds > 0, got {self.duration_s}")
        if self.messages is not None and self.messages < 1:
            raise ValueError(f"messages must be at least 1, got {self.messages}")
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if not self.publish_timeout_s > 0:
            raise ValueError(f"publish_timeout_s must be > 0, got {self.publish_timeout_s}")


@dataclass
class FleetStats:
    sent: int = 0
    """Publishes the broker acknowledged (PUBACK)."""
    publish_errors: int = 0
    """Publishes that failed or timed out, or were cut off by a connection loss."""
    connection_errors: int = 0
    """Lost or failed connections of the publisher (each followed by a reconnect attempt)."""
    silent_turns: int = 0
    dropped_turns: int = 0
    """Turns that were due but skipped: the broker was slow or away."""
    commands: int = 0
    receipts: int = 0
    responder_errors: int = 0

    @property
    def errors(self) -> int:
        return self.publish_errors + self.connection_errors + self.responder_errors


@dataclass(frozen=True)
class Summary:
    devices: int
    mix: Mapping[Pattern, int]
    duration_s: float
    target_rate: float
    stats: FleetStats
    commands_enabled: bool

    @property
    def achieved_rate(self) -> float:
        return self.stats.sent / self.duration_s if self.duration_s > 0 else 0.0

    def render(self) -> str:
        s = self.stats
        mix = ", ".join(f"{pattern.value} {count}" for pattern, count in self.mix.items())
        commands = (
            f"{s.commands} received, {s.receipts} answered"
            if self.commands_enabled
            else "not answered (--no-commands)"
        )
        return "\n".join(
            [
                "gateway-sim devices: summary",
                f"  devices    {self.devices} ({mix})",
                f"  duration   {self.duration_s:.2f} s",
                f"  sent       {s.sent} messages, {self.achieved_rate:.1f} msg/s "
                f"(target {self.target_rate:g} msg/s)",
                f"  turns      {s.silent_turns} silent, "
                f"{s.dropped_turns} dropped (broker slow or away)",
                f"  commands   {commands}",
                f"  errors     {s.errors} (publish {s.publish_errors}, connection "
                f"{s.connection_errors}, responder {s.responder_errors})",
            ]
        )


def progress_line(stats: FleetStats, rate: float) -> str:
    return (
        f"{rate:8.1f} msg/s | sent {stats.sent} | commands {stats.commands} | "
        f"receipts {stats.receipts} | errors {stats.errors}"
    )


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _ConnectionLostError(Exception):
    pass


class DeviceFleet:
    """Runs `FleetConfig` until stopped, ``duration_s`` passes or ``messages`` were sent."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.topics = Topics(config.prefix)
        ids = device_ids(config.devices, config.device_prefix)
        self.devices: list[SimDevice] = fleet(
            ids, config.mix, seed=config.seed, params=config.params
        )
        self._topic_of = [self.topics.telemetry(device_id) for device_id in ids]
        self.stats = FleetStats()
        self.responder: Responder | None = None
        if config.script is not None:
            self.responder = Responder(
                host=config.host,
                port=config.port,
                topics=self.topics,
                script=config.script,
                client_id=f"{config.client_id}-commands",
                protocol=config.protocol,
                encoding=config.encoding,
            )
        self._turn = 0
        self._launched = 0
        self._started: float | None = None
        self._finished = 0.0
        self._backoff_rng = random.Random()

    @property
    def mix(self) -> dict[Pattern, int]:
        return mix_summary([device.pattern for device in self.devices])

    def _new_client(self) -> aiomqtt.Client:
        version = (
            aiomqtt.ProtocolVersion.V5
            if self.config.protocol == "5"
            else aiomqtt.ProtocolVersion.V311
        )
        client = aiomqtt.Client(
            self.config.host,
            self.config.port,
            identifier=self.config.client_id,
            protocol=version,
            max_inflight_messages=self.config.window,
            timeout=self.config.publish_timeout_s,
        )
        # aiomqtt warns past this many publishes awaiting PUBACK; the window bounds them.
        client.pending_calls_threshold = self.config.window + 1
        return client

    def _sync_responder(self) -> None:
        if self.responder is not None:
            self.stats.commands = len(self.responder.received)
            self.stats.receipts = self.responder.answered
            self.stats.responder_errors = self.responder.errors

    async def run(self, stop: asyncio.Event, *, progress: TextIO | None = None) -> Summary:
        """Simulate until ``stop`` is set (a limit reached sets it too); the progress line goes
        to ``progress`` about once a second.

        Raises `BrokerUnavailableError` when the first connection fails.
        """
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tasks:
            try:
                unavailable = await self._publish_until_stopped(stop, tasks, progress)
            finally:
                stop.set()
        if unavailable is not None:
            raise unavailable
        self._sync_responder()
        started = loop.time() if self._started is None else self._started
        return Summary(
            devices=len(self.devices),
            mix=self.mix,
            duration_s=self._finished - started,
            target_rate=self.config.rate,
            stats=self.stats,
            commands_enabled=self.responder is not None,
        )

    async def _start(
        self, stop: asyncio.Event, tasks: asyncio.TaskGroup, progress: TextIO | None
    ) -> Pacer:
        """Once connected for the first time: answer commands, start the clock and limits."""
        loop = asyncio.get_running_loop()
        if self.responder is not None:
            tasks.create_task(self.responder.run(stop), name="sim-devices-responder")
            await self._wait_subscribed(self.responder, stop)
        self._started = loop.time()
        if self.config.duration_s is not None:
            tasks.create_task(
                _stop_after(self.config.duration_s, stop), name="sim-devices-duration"
            )
        if progress is not None:
            tasks.create_task(self._progress(progress, stop), name="sim-devices-progress")
        return Pacer(self.config.rate, self._started, default_max_lag(self.config.rate))

    async def _wait_subscribed(self, responder: Responder, stop: asyncio.Event) -> None:
        # Commands published before the responder's first subscription would be lost; wait
        # for it, but only so long: a broker refusing it must not stop the telemetry.
        waits = [
            asyncio.create_task(responder.wait_subscribed()),
            asyncio.create_task(stop.wait()),
        ]
        try:
            await asyncio.wait(waits, timeout=SUBSCRIBE_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _publish_until_stopped(
        self, stop: asyncio.Event, tasks: asyncio.TaskGroup, progress: TextIO | None
    ) -> BrokerUnavailableError | None:
        """One connection after the other until ``stop``; the error if the first one fails."""
        loop = asyncio.get_running_loop()
        pacer: Pacer | None = None
        attempt = 0
        try:
            while not stop.is_set():
                try:
                    async with self._new_client() as client:
                        if pacer is None:
                            pacer = await self._start(stop, tasks, progress)
                        attempt = 0
                        await self._connection(client, pacer, stop)
                except (aiomqtt.MqttError, _ConnectionLostError) as exc:
                    if pacer is None:
                        config = self.config
                        return BrokerUnavailableError(
                            config.host,
                            config.port,
                            config.protocol,
                            str(exc),
                            refused=isinstance(exc, aiomqtt.MqttCodeError),  # CONNACK refused
                        )
                    if stop.is_set():  # a failed DISCONNECT at the end is no lost connection
                        break
                    self.stats.connection_errors += 1
                    delay = reconnect_delay_s(attempt, self._backoff_rng)
                    attempt += 1
                    log.warning(
                        "devices_connection_lost",
                        error=str(exc),
                        attempt=attempt,
                        retry_in_s=round(delay, 3),
                    )
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await stop.wait()
        finally:
            self._finished = loop.time()
            if pacer is not None:
                self.stats.dropped_turns = pacer.dropped
        return None

    async def _connection(self, client: aiomqtt.Client, pacer: Pacer, stop: asyncio.Event) -> None:
        """Publish on ``client`` until ``stop``; raise `_ConnectionLostError` if it drops."""
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self.config.window)
        in_flight: set[asyncio.Task[None]] = set()
        # The publisher subscribes to nothing: its message stream only ends, with an error,
        # when the connection is lost. That is the one public signal aiomqtt gives for it.
        lost = asyncio.create_task(_until_lost(client), name="sim-devices-watch")
        # A dead connection's publishes would only time out: cancel them at once (their fate
        # is unknown, so they count as errors), which also frees the slots a turn may await.
        lost.add_done_callback(lambda _: _cancel_all(in_flight))
        stopping = asyncio.create_task(stop.wait(), name="sim-devices-stop")
        try:
            while not stop.is_set() and not lost.done():
                batch = pacer.due(loop.time())
                for n in range(batch):
                    if stop.is_set() or lost.done():
                        pacer.untake(batch - n)
                        break
                    if n and n % _TURNS_PER_YIELD == 0:
                        await asyncio.sleep(0)
                    await self._turn_once(client, slots, in_flight, lost, stop)
                delay = max(0.0, pacer.next_due_s() - loop.time())
                await asyncio.wait(
                    (lost, stopping), timeout=delay, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            stopping.cancel()
            # Stopping: the publishes in flight finish or time out (publish_timeout_s) before
            # the DISCONNECT.
            await asyncio.gather(*in_flight, return_exceptions=True)
            lost.cancel()
            await asyncio.gather(lost, stopping, return_exceptions=True)
        if not stop.is_set():
            raise _ConnectionLostError(lost.result())  # the loop ends on stop or on this

    async def _turn_once(
        self,
        client: aiomqtt.Client,
        slots: asyncio.Semaphore,
        in_flight: set[asyncio.Task[None]],
        lost: asyncio.Task[str],
        stop: asyncio.Event,
    ) -> None:
        index = self._turn % len(self.devices)
        self._turn += 1
        message = self.devices[index].next_message(_now_ms())
        if message is None:
            self.stats.silent_turns += 1
            return
        payload = encode_telemetry(message, self.config.encoding)
        await slots.acquire()
        if lost.done():  # while waiting for the slot: the message goes nowhere
            slots.release()
            self.stats.publish_errors += 1
            return
        task = asyncio.create_task(self._publish(client, self._topic_of[index], payload, slots))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        self._launched += 1
        if self.config.messages is not None and self._launched >= self.config.messages:
            stop.set()

    async def _publish(
        self, client: aiomqtt.Client, topic: str, payload: bytes, slots: asyncio.Semaphore
    ) -> None:
        try:
            await client.publish(topic, payload, qos=1, timeout=self.config.publish_timeout_s)
        except aiomqtt.MqttError:
            self.stats.publish_errors += 1
        except asyncio.CancelledError:
            self.stats.publish_errors += 1
            raise
        else:
            self.stats.sent += 1
        finally:
            slots.release()

    async def _progress(self, stream: TextIO, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        last_sent, last_at = self.stats.sent, loop.time()
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PROGRESS_INTERVAL_S):
                        await stop.wait()
                now = loop.time()
                self._sync_responder()
                rate = (self.stats.sent - last_sent) / max(now - last_at, 1e-9)
                last_sent, last_at = self.stats.sent, now
                # \r and erase-to-end-of-line: one line, rewritten in place.
                stream.write(f"\r{progress_line(self.stats, rate)}\x1b[K")
                stream.flush()
        finally:
            stream.write("\n")
            stream.flush()


def _cancel_all(tasks: set[asyncio.Task[None]]) -> None:
    for task in list(tasks):
        task.cancel()


async def _stop_after(seconds: float, stop: asyncio.Event) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()
    stop.set()


async def _until_lost(client: aiomqtt.Client) -> str:
    """Wait until ``client`` loses its connection; say why."""
    try:
        async for _ in client.messages:
            pass
    except aiomqtt.MqttError as exc:
        cause = exc.__cause__
        return f"{exc}: {cause}" if cause is not None else str(exc)
    return "message stream ended"
