"""The demo's hand-made devices, beside the simulated fleet: each on its own MQTT connection.

- **Hubs with presence** (``demo-hub-1`` … ``demo-hub-3``): each connects with a Will (its
  retained status topic, ``offline``), publishes its birth (``online``, retained), then a reading
  every few seconds. ``demo-hub-3`` is a flaky one: every `FLAKY_ONLINE_S` it loses its
  connection without a goodbye (the first time after `FLAKY_FIRST_ONLINE_S`), the broker
  publishes its Will, the gateway records it ``offline`` (the inactivity rule raises its alarm
  and the demo's webhook is notified), and `FLAKY_AWAY_S` later it comes back with a new birth
  and its readings (the alarm returns to normal).
- **A chattering device** (``demo-fan-1``): its vibration hovers around the ``fan-vibration``
  rule's threshold, which has almost no deadband, so the rule raises and clears several times a
  minute: the bad actor that the alarm figures are there to find.
- **A Sparkplug B edge node** (group ``Demo``, node ``Line1``, devices ``Oven`` and ``Pump``:
  ``Demo/Line1/Oven``, ``Demo/Line1/Pump`` in the gateway), with births, data by alias, a
  ``bdSeq`` Will, rebirths on request, and metric writes reported back
  (gateway/demo/sparkplug_edge.py).
- **Two Tasmota devices** (``tasmota-plug-1``, ``tasmota-climate-1``) on Tasmota's own topics,
  read by the demo's ``tasmota`` mapping (gateway/demo/tasmota.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import struct
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final, Self

import aiomqtt
import structlog

from gateway.demo.sparkplug_edge import DemoEdgeNode
from gateway.demo.tasmota import DEVICES as TASMOTA_DEVICES
from gateway.demo.tasmota import TasmotaDevice, run_tasmota
from protocol import Telemetry, Topics, encode_telemetry
from sim.wire import DISCONNECT, WireError, remaining_length

log = structlog.get_logger(__name__)

HUBS: Final = ("demo-hub-1", "demo-hub-2", "demo-hub-3")
FLAKY_HUB: Final = "demo-hub-3"
HUB_INTERVAL_S: Final = 5.0
# The first cut comes soon, so a newcomer sees a Will (and a notification) in the first minute.
FLAKY_FIRST_ONLINE_S: Final = 15.0
FLAKY_ONLINE_S: Final = 90.0
FLAKY_AWAY_S: Final = 40.0

CHATTER_DEVICE: Final = "demo-fan-1"
CHATTER_INTERVAL_S: Final = 2.0
# Above the rule's 7.0 mm/s for two readings, just below it for three: a raise every 10 s,
# six a minute (EEMUA 191 calls three a minute chattering).
CHATTER_CYCLE: Final = (7.3, 7.2, 6.9, 6.8, 6.9)
RETRY_S: Final = 2.0
KEEPALIVE_S: Final = 60
CONNECT_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True)
class DemoDevices:
    host: str
    port: int
    topics: Topics

    async def run(self, stop: asyncio.Event, subscribed: asyncio.Event | None = None) -> None:
        """Every hand-made device until ``stop``; a lost broker is retried, never fatal.

        The devices that subscribe (to their commands) connect one after the other, each once
        the one before has subscribed, and ``subscribed`` is set after the last: the embedded
        broker (amqtt 0.12) drops a connection whose CONNECT it handles while another client
        subscribes (it walks every subscription to hand the newcomer retained messages, and
        the walk fails when a subscription is added meanwhile)."""
        async with asyncio.TaskGroup() as tasks:
            edge = DemoEdgeNode(self.host, self.port)
            starts: list[tuple[str, Callable[[asyncio.Event], Coroutine[Any, Any, None]]]] = [
                ("demo-sparkplug-edge-node", functools.partial(edge.run, stop))
            ]
            for name in TASMOTA_DEVICES:
                device = TasmotaDevice(name)
                starts.append(
                    (
                        f"demo-{name}",
                        functools.partial(run_tasmota, self.host, self.port, device, stop),
                    )
                )
            for task_name, start in starts:
                ready = asyncio.Event()
                tasks.create_task(start(ready), name=task_name)
                await _until(ready, stop, CONNECT_TIMEOUT_S)
            if subscribed is not None:
                subscribed.set()
            for hub in HUBS:
                tasks.create_task(self._hub(hub, stop), name=f"demo-{hub}")
            tasks.create_task(self._chatter(stop), name="demo-chatter")

    async def _hub(self, device_id: str, stop: asyncio.Event) -> None:
        flaky = device_id == FLAKY_HUB
        seq = itertools.count()
        online_for = FLAKY_FIRST_ONLINE_S if flaky else None
        while not stop.is_set():
            try:
                async with _HubConnection(self.host, self.port, device_id, self.topics) as hub:
                    await hub.publish(self.topics.device_status(device_id), b"online", retain=True)
                    await self._readings(hub, device_id, seq, stop, online_for)
                    if flaky and not stop.is_set():
                        hub.drop_without_goodbye()
                        online_for = FLAKY_ONLINE_S
            except (OSError, asyncio.IncompleteReadError, WireError) as exc:
                log.warning("demo_device_connection_lost", device=device_id, error=str(exc))
            await _wait(stop, FLAKY_AWAY_S if flaky else RETRY_S)

    async def _readings(
        self,
        hub: _HubConnection,
        device_id: str,
        seq: Iterator[int],
        stop: asyncio.Event,
        online_for: float | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        until = None if online_for is None else loop.time() + online_for
        while not stop.is_set() and (until is None or loop.time() < until):
            n = next(seq)
            reading = Telemetry(
                ts=datetime.now(UTC),
                seq=n,
                metrics={"uptime_s": n * HUB_INTERVAL_S, "rssi": -60 - n % 7},
            )
            await hub.publish(self.topics.telemetry(device_id), encode_telemetry(reading))
            await _wait(stop, HUB_INTERVAL_S)

    async def _chatter(self, stop: asyncio.Event) -> None:
        values = itertools.cycle(CHATTER_CYCLE)
        seq = itertools.count()
        while not stop.is_set():
            try:
                async with aiomqtt.Client(
                    self.host,
                    self.port,
                    identifier=f"gateway-demo-{CHATTER_DEVICE}",
                    protocol=aiomqtt.ProtocolVersion.V311,  # the embedded broker's
                ) as client:
                    while not stop.is_set():
                        reading = Telemetry(
                            ts=datetime.now(UTC),
                            seq=next(seq),
                            metrics={"vibration": next(values)},
                        )
                        await client.publish(
                            self.topics.telemetry(CHATTER_DEVICE),
                            encode_telemetry(reading),
                            qos=1,
                        )
                        await _wait(stop, CHATTER_INTERVAL_S)
            except aiomqtt.MqttError as exc:
                log.warning("demo_device_connection_lost", device=CHATTER_DEVICE, error=str(exc))
            await _wait(stop, RETRY_S)


class _HubConnection:
    """One device's MQTT 3.1.1 connection with a Will: CONNECT, QoS 1 publishes (their
    PUBACKs read and dropped), and either a DISCONNECT (the Will is discarded) or a cut without
    one (the broker publishes the Will), which a client library would not do on purpose."""

    def __init__(self, host: str, port: int, device_id: str, topics: Topics) -> None:
        self.host, self.port = host, port
        self.client_id = f"gateway-demo-{device_id}"
        self.will_topic = topics.device_status(device_id)
        self._writer: asyncio.StreamWriter | None = None
        self._acks: asyncio.Task[None] | None = None
        self._packet_ids = itertools.cycle(range(1, 65536))
        self._dropped = False

    async def __aenter__(self) -> Self:
        reader, self._writer = await asyncio.open_connection(self.host, self.port)
        will_flags = 0x04 | 0x08 | 0x20  # will, will QoS 1, will retain
        body = (
            _string("MQTT")
            + bytes([4, 0x02 | will_flags])  # level 4 (3.1.1), clean session
            + struct.pack("!H", KEEPALIVE_S)
            + _string(self.client_id)
            + _string(self.will_topic)
            + _string("offline")
        )
        self._writer.write(bytes([0x10]) + remaining_length(len(body)) + body)
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            ack = await reader.readexactly(4)
        if ack[0] != 0x20 or ack[3] != 0:
            raise WireError(f"connection refused: CONNACK {ack.hex()}")
        self._acks = asyncio.create_task(_drain(reader), name=f"{self.client_id}-acks")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._acks is not None:
            self._acks.cancel()
        writer, self._writer = self._writer, None
        if writer is None:
            return
        if not self._dropped:
            with contextlib.suppress(OSError):
                writer.write(DISCONNECT)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        assert self._writer is not None
        if self._acks is not None and self._acks.done():
            raise WireError("the broker closed the connection")
        head = _string(topic) + struct.pack("!H", next(self._packet_ids))
        first = 0x32 | (0x01 if retain else 0)  # PUBLISH, QoS 1
        self._writer.write(bytes([first]) + remaining_length(len(head) + len(payload)) + head)
        self._writer.write(payload)
        await self._writer.drain()

    def drop_without_goodbye(self) -> None:
        """Cut the TCP connection, as a device losing power would: no DISCONNECT reaches the
        broker, which then publishes the Will."""
        if self._writer is not None:
            self._dropped = True
            self._writer.transport.abort()


async def _drain(reader: asyncio.StreamReader) -> None:
    """Read and drop what the broker sends (PUBACKs) until it closes the connection."""
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while await reader.read(4096):
            pass


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("!H", len(raw)) + raw


async def _until(event: asyncio.Event, stop: asyncio.Event, seconds: float) -> None:
    """Until ``event`` or ``stop`` is set, for at most ``seconds``."""
    waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()
