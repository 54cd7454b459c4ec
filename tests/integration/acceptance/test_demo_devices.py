"""The demo's Sparkplug edge node and Tasmota plug on a real mosquitto, watched from the wire:
births then data in one seq, a rebirth on request, a write reported back (an out-of-range one
not), the NDEATH of its bdSeq at a clean stop; the plug's LWT, readings and POWER answers
(gateway/demo/sparkplug_edge.py, gateway/demo/tasmota.py). The whole demo, with the gateway
reading them, is test_demo.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiomqtt

from gateway.demo.sparkplug_edge import DemoEdgeNode
from gateway.demo.tasmota import PLUG, TasmotaDevice, run_tasmota
from protocol import sparkplug
from protocol.sparkplug import DataType, SparkplugPayload
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


@dataclass
class Wire:
    client: aiomqtt.Client
    seen: list[tuple[str, bytes, bool]] = field(default_factory=list)  # topic, payload, retain

    def topics(self) -> list[str]:
        return [topic for topic, _, _ in self.seen]

    def sparkplug(self) -> list[tuple[sparkplug.SparkplugTopic, SparkplugPayload]]:
        return [
            (sparkplug.parse_topic(topic), sparkplug.decode_payload(payload))
            for topic, payload, _ in self.seen
            if sparkplug.is_topic(topic)
        ]


@contextlib.asynccontextmanager
async def watching(port: int, *filters: str) -> AsyncIterator[Wire]:
    async with aiomqtt.Client("127.0.0.1", port, identifier="demo-devices-watcher") as client:
        for topic_filter in filters:
            await client.subscribe(topic_filter, qos=1)
        wire = Wire(client)

        async def read() -> None:
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                wire.seen.append((message.topic.value, message.payload, message.retain))

        reader = asyncio.create_task(read())
        try:
            yield wire
        finally:
            reader.cancel()


@contextlib.asynccontextmanager
async def running(
    work: Callable[[asyncio.Event], Coroutine[Any, Any, None]],
) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(work(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


def _now_ms() -> int:
    return int(time.time() * 1000)


async def test_the_edge_node_births_rebirths_confirms_writes_and_dies_with_its_bdseq(
    mosquitto: Mosquitto,
) -> None:
    async with watching(mosquitto.port, "spBv1.0/Demo/#") as wire:
        edge = DemoEdgeNode("127.0.0.1", mosquitto.port, seed=1)
        async with running(edge.run):

            def count(kind: sparkplug.MessageType, device: str | None = None) -> int:
                return sum(1 for t, _ in wire.sparkplug() if t.type is kind and t.device == device)

            await wait_until(
                lambda: count(sparkplug.MessageType.DDATA, "Oven") >= 2,
                timeout=30,
                message="births, then the oven's data",
            )
            births = [(t, p) for t, p in wire.sparkplug() if "BIRTH" in t.type.value]
            assert [(t.type.value, t.device) for t, _ in births] == [
                ("NBIRTH", None), ("DBIRTH", "Oven"), ("DBIRTH", "Pump"),
            ]  # fmt: skip
            assert births[0][1].bdseq() == 0
            aliases = {m.alias: m for _, p in births[1:] for m in p.metrics}

            # A rebirth request (what the host sends on a gap): the births again, seq from 0.
            await wire.client.publish(
                sparkplug.topic("Demo", sparkplug.MessageType.NCMD, "Line1"),
                sparkplug.encode_rebirth(_now_ms()),
                qos=1,
            )
            await wait_until(
                lambda: (
                    count(sparkplug.MessageType.NBIRTH) == 2
                    and count(sparkplug.MessageType.DBIRTH, "Pump") == 2
                ),
                timeout=30,
                message="the births again",
            )

            # Writes as the gateway sends them: one out of range (not applied), one in range,
            # reported back at once by alias.
            dcmd = sparkplug.topic("Demo", sparkplug.MessageType.DCMD, "Line1", "Oven")
            for value in (400.0, 210.0):
                await wire.client.publish(
                    dcmd,
                    sparkplug.encode_write(_now_ms(), [("Setpoint", None, DataType.DOUBLE, value)]),
                    qos=1,
                )

            def setpoints() -> list[object]:
                return [
                    sparkplug.metric_value(m, aliases[m.alias].datatype)
                    for t, p in wire.sparkplug()
                    if t.type is sparkplug.MessageType.DDATA
                    for m in p.metrics
                    if m.alias is not None and aliases[m.alias].name == "Setpoint"
                ]

            await wait_until(lambda: setpoints() == [210.0], timeout=30, message="the echo")
        # Stopped cleanly: the NDEATH of the session's bdSeq.
        await wait_until(
            lambda: count(sparkplug.MessageType.NDEATH) == 1, timeout=30, message="NDEATH"
        )
        messages = wire.sparkplug()
        (death,) = [p for t, p in messages if t.type is sparkplug.MessageType.NDEATH]
        assert death.bdseq() == 0
        # One seq over the node's messages, 0 at each NBIRTH, never skipping.
        expected = 0
        for topic, payload in messages:
            if topic.type is sparkplug.MessageType.NDEATH:
                continue
            if topic.type is sparkplug.MessageType.NBIRTH:
                expected = 0
            if topic.type in (sparkplug.MessageType.NCMD, sparkplug.MessageType.DCMD):
                continue
            assert payload.seq == expected, (topic, payload.seq, expected)
            expected = (expected + 1) % 256


async def test_the_plug_says_online_reports_and_answers_power_as_tasmota(
    mosquitto: Mosquitto,
) -> None:
    async with watching(
        mosquitto.port, f"tele/{PLUG}/#", f"stat/{PLUG}/#"
    ) as wire:  # fmt: skip
        plug = TasmotaDevice(PLUG)
        async with running(lambda stop: run_tasmota("127.0.0.1", mosquitto.port, plug, stop)):
            await wait_until(
                lambda: f"tele/{PLUG}/SENSOR" in wire.topics(), timeout=30, message="a reading"
            )
            assert (f"tele/{PLUG}/LWT", b"Online", False) in wire.seen
            reading = json.loads(next(p for t, p, _ in wire.seen if t.endswith("/SENSOR")))
            assert reading["ENERGY"]["Power"] > 0
            await wire.client.publish(f"cmnd/{PLUG}/POWER", b"OFF", qos=1)
            await wait_until(
                lambda: (f"stat/{PLUG}/POWER", b"OFF", False) in wire.seen,
                timeout=30,
                message="the POWER answer",
            )
            assert (f"stat/{PLUG}/RESULT", b'{"POWER":"OFF"}', False) in wire.seen
            assert plug.power_on is False
        await wait_until(
            lambda: (f"tele/{PLUG}/LWT", b"Offline", False) in wire.seen,
            timeout=30,
            message="Offline at a clean stop",
        )
    # The LWT is retained: a newcomer reads the last word.
    async with watching(mosquitto.port, f"tele/{PLUG}/LWT") as late:
        await wait_until(lambda: bool(late.seen), timeout=30, message="the retained LWT")
        assert late.seen == [(f"tele/{PLUG}/LWT", b"Offline", True)]
