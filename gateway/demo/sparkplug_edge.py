"""The demo's Sparkplug B edge node (Eclipse Sparkplug 3.0): group `GROUP`, node `NODE`, with
two devices, ``Oven`` and ``Pump`` — in the gateway, ``Demo/Line1/Oven`` and
``Demo/Line1/Pump`` (docs/sparkplug.md).

It behaves as an edge node should, written with the project's own protobuf module
(``protocol.sparkplug_b_pb2``, Eclipse Tahu's ``sparkplug_b.proto``):

- its MQTT Will is its ``NDEATH`` carrying the session's ``bdSeq``, which its ``NBIRTH`` carries
  too, and which goes up by one at every new connection (0..255);
- the ``NBIRTH`` (``bdSeq``, ``Node Control/Rebirth``) and each device's ``DBIRTH`` define every
  metric with its name, datatype and **alias**; ``DDATA`` then names the metrics by alias only;
- one ``seq`` (0..255, wrapping) over the node's messages, 0 in the ``NBIRTH``;
- an ``NCMD`` ``Node Control/Rebirth`` publishes the births again (the host asks for one when
  it loses track of the stream);
- a ``DCMD`` writes the device's writable metrics (the oven's ``Setpoint``, the pump's
  ``Running``), applied and **reported back in a DDATA at once**: Sparkplug has no receipt, and
  the gateway takes that reported value as the command's ACK (docs/commands.md). A write out of
  range (a ``Setpoint`` outside 100..300 °C) is not applied, so that command fails after the
  gateway's ack window, as a real device's refusal would.

The oven's temperature follows its setpoint (a first-order lag with a little noise), so a
``Setpoint`` above 250 °C makes the demo's ``oven-overheat`` rule fire some seconds later; the
pump's pressure and flow fall to zero while it is stopped. Data go out at QoS 0 as Sparkplug
says; a message the broker loses is a seq gap, which the host answers with a rebirth request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

import aiomqtt
import structlog
from google.protobuf.message import DecodeError

from protocol import sparkplug
from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType, MessageType, SparkplugValue

log = structlog.get_logger(__name__)

GROUP: Final = "Demo"
NODE: Final = "Line1"
OVEN: Final = "Oven"
PUMP: Final = "Pump"
DATA_INTERVAL_S: Final = 2.0
RETRY_S: Final = 2.0
KEEPALIVE_S: Final = 30
# The oven moves this fraction of the way to its setpoint at each sample.
OVEN_LAG: Final = 0.15
OVEN_SETPOINT_C: Final = 180.0
OVEN_SETPOINT_RANGE: Final = (100.0, 300.0)
PUMP_PRESSURE_BAR: Final = 3.2
PUMP_FLOW_M3H: Final = 12.5


@dataclass
class Metric:
    name: str
    alias: int
    datatype: DataType
    value: SparkplugValue
    writable: bool = False
    # What a write may set, for a number.
    low: float = float("-inf")
    high: float = float("inf")


@dataclass
class _Device:
    name: str
    metrics: dict[str, Metric]

    def by_alias(self, alias: int) -> Metric | None:
        return next((m for m in self.metrics.values() if m.alias == alias), None)


@dataclass
class EdgeState:
    """The edge node's process values: what the births report and the data update."""

    rng: random.Random = field(default_factory=random.Random)
    devices: dict[str, _Device] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.devices = {
            OVEN: _Device(
                OVEN,
                {
                    "Temperature": Metric("Temperature", 10, DataType.DOUBLE, OVEN_SETPOINT_C),
                    "Setpoint": Metric(
                        "Setpoint",
                        11,
                        DataType.DOUBLE,
                        OVEN_SETPOINT_C,
                        writable=True,
                        low=OVEN_SETPOINT_RANGE[0],
                        high=OVEN_SETPOINT_RANGE[1],
                    ),
                    "Door Open": Metric("Door Open", 12, DataType.BOOLEAN, False),
                },
            ),
            PUMP: _Device(
                PUMP,
                {
                    "Pressure": Metric("Pressure", 20, DataType.FLOAT, PUMP_PRESSURE_BAR),
                    "Flow": Metric("Flow", 21, DataType.FLOAT, PUMP_FLOW_M3H),
                    "Running": Metric("Running", 22, DataType.BOOLEAN, True, writable=True),
                },
            ),
        }

    def step(self) -> dict[str, list[Metric]]:
        """One sample of every device: the metrics that changed."""
        oven = self.devices[OVEN].metrics
        temp, setpoint = oven["Temperature"].value, oven["Setpoint"].value
        assert isinstance(temp, float)
        assert isinstance(setpoint, float)
        oven["Temperature"].value = round(
            temp + OVEN_LAG * (setpoint - temp) + self.rng.gauss(0, 0.4), 2
        )
        pump = self.devices[PUMP].metrics
        running = pump["Running"].value is True
        pump["Pressure"].value = (
            round(PUMP_PRESSURE_BAR + self.rng.gauss(0, 0.05), 3) if running else 0.0
        )
        pump["Flow"].value = round(PUMP_FLOW_M3H + self.rng.gauss(0, 0.2), 2) if running else 0.0
        return {
            OVEN: [oven["Temperature"]],
            PUMP: [pump["Pressure"], pump["Flow"]],
        }

    def write(self, device: str, metric: pb.Payload.Metric) -> Metric | None:
        """Apply one metric of a DCMD; the metric written, or None when it is not applied (an
        unknown or read-only metric, a value of the wrong kind or out of range)."""
        target = self.devices.get(device)
        if target is None:
            return None
        found = (
            target.metrics.get(metric.name)
            if metric.HasField("name")
            else target.by_alias(metric.alias)
        )
        if found is None or not found.writable:
            return None
        which = metric.WhichOneof("value")
        value = getattr(metric, which) if which is not None else None
        if found.datatype is DataType.BOOLEAN:
            if not isinstance(value, bool):
                return None
            found.value = value
        else:
            if isinstance(value, bool) or not isinstance(value, int | float):
                return None
            if not found.low <= float(value) <= found.high:
                return None
            found.value = float(value)
        return found


def _add(payload: pb.Payload, metric: Metric, now_ms: int, *, birth: bool) -> None:
    """A metric into a payload: named, with its datatype, in a birth; by alias alone after."""
    out = payload.metrics.add()
    if birth:
        out.name = metric.name
        out.datatype = metric.datatype
    out.alias = metric.alias
    out.timestamp = now_ms
    value = metric.value
    if metric.datatype is DataType.BOOLEAN:
        out.boolean_value = bool(value)
    elif metric.datatype is DataType.DOUBLE:
        assert isinstance(value, int | float)
        out.double_value = float(value)
    elif metric.datatype is DataType.FLOAT:
        assert isinstance(value, int | float)
        out.float_value = float(value)
    elif metric.datatype is DataType.STRING:
        out.string_value = str(value)
    else:
        assert isinstance(value, int)
        out.long_value = value & ((1 << 64) - 1)


def death_payload(bdseq: int) -> bytes:
    """The NDEATH (the connection's Will): only the ``bdSeq`` of the session it ends."""
    payload = pb.Payload(timestamp=_now_ms())
    metric = payload.metrics.add()
    metric.name = sparkplug.BDSEQ
    metric.datatype = DataType.INT64
    metric.long_value = bdseq
    return payload.SerializeToString()


def births(
    state: EdgeState, bdseq: int, seq: Iterator[int], now_ms: int
) -> list[tuple[str, bytes]]:
    """The NBIRTH (``bdSeq``, ``Node Control/Rebirth``; ``seq`` 0 from a fresh ``seq``) and each
    device's DBIRTH (every metric named, typed and aliased): (topic, payload)s, in order."""
    node = pb.Payload(timestamp=now_ms, seq=next(seq))
    named = node.metrics.add()  # bdSeq: named, never aliased
    named.name, named.datatype, named.long_value = sparkplug.BDSEQ, DataType.INT64, bdseq
    named.timestamp = now_ms
    _add(node, Metric(sparkplug.REBIRTH, 1, DataType.BOOLEAN, False), now_ms, birth=True)
    out = [(sparkplug.topic(GROUP, MessageType.NBIRTH, NODE), node.SerializeToString())]
    for device in state.devices.values():
        birth = pb.Payload(timestamp=now_ms, seq=next(seq))
        for metric in device.metrics.values():
            _add(birth, metric, now_ms, birth=True)
        out.append(
            (
                sparkplug.topic(GROUP, MessageType.DBIRTH, NODE, device.name),
                birth.SerializeToString(),
            )
        )
    return out


def data(device: str, metrics: list[Metric], seq: int, now_ms: int) -> tuple[str, bytes]:
    """A DDATA of ``device``: its metrics by alias alone (no name, no datatype)."""
    payload = pb.Payload(timestamp=now_ms, seq=seq)
    for metric in metrics:
        _add(payload, metric, now_ms, birth=False)
    return sparkplug.topic(GROUP, MessageType.DDATA, NODE, device), payload.SerializeToString()


def _now_ms() -> int:
    return int(time.time() * 1000)


class DemoEdgeNode:
    """The edge node on its own MQTT connection, until ``stop``; a lost broker is retried
    with the next ``bdSeq``."""

    def __init__(self, host: str, port: int, *, seed: int | None = None) -> None:
        self.host, self.port = host, port
        self.state = EdgeState(rng=random.Random(seed))
        self._bdseq = itertools.cycle(range(256))
        self._seq: Iterator[int] = itertools.cycle(range(256))
        self._lock = asyncio.Lock()

    @property
    def node_key(self) -> str:
        return f"{GROUP}/{NODE}"

    async def run(self, stop: asyncio.Event, subscribed: asyncio.Event | None = None) -> None:
        """``subscribed`` is set once it has subscribed to its commands (the first time)."""
        while not stop.is_set():
            bdseq = next(self._bdseq)
            will = aiomqtt.Will(
                sparkplug.topic(GROUP, MessageType.NDEATH, NODE), death_payload(bdseq), qos=1
            )
            try:
                async with aiomqtt.Client(
                    self.host,
                    self.port,
                    identifier=f"gateway-demo-sparkplug-{GROUP}-{NODE}",
                    protocol=aiomqtt.ProtocolVersion.V311,  # the embedded broker's
                    keepalive=KEEPALIVE_S,
                    will=will,
                ) as client:
                    await client.subscribe(sparkplug.topic(GROUP, MessageType.NCMD, NODE), qos=1)
                    await client.subscribe(
                        f"{sparkplug.NAMESPACE}/{GROUP}/{MessageType.DCMD.value}/{NODE}/+", qos=1
                    )
                    if subscribed is not None:
                        subscribed.set()
                    await self._births(client, bdseq)
                    async with asyncio.TaskGroup() as tasks:
                        reader = tasks.create_task(self._commands(client, bdseq))
                        await self._data(client, stop)
                        reader.cancel()
                    # A clean stop: the NDEATH the Will would have been, then DISCONNECT.
                    await client.publish(
                        sparkplug.topic(GROUP, MessageType.NDEATH, NODE),
                        death_payload(bdseq),
                        qos=1,
                    )
            except aiomqtt.MqttError as exc:
                log.warning("demo_device_connection_lost", device=self.node_key, error=str(exc))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RETRY_S):
                    await stop.wait()

    async def _births(self, client: aiomqtt.Client, bdseq: int) -> None:
        async with self._lock:
            self._seq = itertools.cycle(range(256))
            for topic, payload in births(self.state, bdseq, self._seq, _now_ms()):
                await client.publish(topic, payload, qos=0)

    async def _publish(self, client: aiomqtt.Client, device: str, metrics: list[Metric]) -> None:
        """A device's data, by alias, with the node's next seq (sent in seq order)."""
        async with self._lock:
            topic, payload = data(device, metrics, next(self._seq), _now_ms())
            await client.publish(topic, payload, qos=0)

    async def _data(self, client: aiomqtt.Client, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for device, changed in self.state.step().items():
                await self._publish(client, device, changed)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DATA_INTERVAL_S):
                    await stop.wait()

    async def _commands(self, client: aiomqtt.Client, bdseq: int) -> None:
        ncmd = sparkplug.topic(GROUP, MessageType.NCMD, NODE)
        dcmd = f"{sparkplug.NAMESPACE}/{GROUP}/{MessageType.DCMD.value}/{NODE}/+"
        async for message in client.messages:
            # The embedded broker (amqtt 0.12) sometimes hands a connection retained messages of
            # another client's subscription: only our command topics are read.
            if message.topic.matches(ncmd):
                await self._ncmd(client, bdseq, message.payload)
            elif message.topic.matches(dcmd):
                await self._dcmd(client, message.topic.value.rsplit("/", 1)[1], message.payload)

    async def _ncmd(self, client: aiomqtt.Client, bdseq: int, raw: bytes) -> None:
        payload = pb.Payload()
        try:
            payload.ParseFromString(raw)
        except DecodeError:
            log.warning("demo_sparkplug_command_undecodable", topic="NCMD")
            return
        if any(m.name == sparkplug.REBIRTH and m.boolean_value for m in payload.metrics):
            log.info("demo_sparkplug_rebirth", node=self.node_key)
            await self._births(client, bdseq)

    async def _dcmd(self, client: aiomqtt.Client, device: str, raw: bytes) -> None:
        payload = pb.Payload()
        try:
            payload.ParseFromString(raw)
        except DecodeError:
            log.warning("demo_sparkplug_command_undecodable", topic="DCMD", device=device)
            return
        applied = (self.state.write(device, metric) for metric in payload.metrics)
        written = [metric for metric in applied if metric is not None]
        if not written:
            log.info("demo_sparkplug_write_refused", device=device)
            return
        # Reported back at once: the host's confirmation of the write (its ACK).
        await self._publish(client, device, written)
