"""A pysparkplug (0.6.1) edge node stopped cleanly and started again, then reconnecting once (a
broker blip, a takeover): it is online and its data stored.

pysparkplug starts its bdSeq at 0 in each process, and its clean disconnect sends an ``NDEATH``
with the *next* session's bdSeq (1 after a first session's birth of 0). The host kept that
death (``dead_bdseq``) for the NBIRTH of bdSeq 1, and the new process's NBIRTH (bdSeq 0, "the
session before") did not forget it: at the new process's first reconnect, its NBIRTH (bdSeq
1, the Will it connected with) was taken for a session found dead. The node and its devices
showed offline while it served, and its data was dead-lettered ``SPARKPLUG_NOT_BORN`` (the
rebirth requests go unanswered: pysparkplug has none) until it reconnected again.

A real daemon, mosquitto and pysparkplug in its own venv (tests/support/sparkplug/.pyvenv)."""

from __future__ import annotations

import asyncio
import json

import aiomqtt
import asyncpg

from protocol import sparkplug
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.sparkplug_edge import pysparkplug_python
from tests.support.waiting import wait_until

CLIENT_ID = "pysparkplug-Plant2-Cell1"
CONFIG = """
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["Plant2"]
"""

# pysparkplug's edge node: births and one DDATA; then, a line at a time on stdin, `data <v>`
# (a DDATA of the pump's temp) or `disconnect` (its clean disconnect).
EDGE = """
import sys, threading
import pysparkplug as sp

host, port = sys.argv[1], int(sys.argv[2])
now = sp.get_current_timestamp
edge = sp.EdgeNode(
    group_id="Plant2", edge_node_id="Cell1",
    metrics=[sp.Metric(timestamp=now(), name="Firmware", datatype=sp.DataType.STRING, value="1.2")],
    client=sp.Client(client_id="CLIENT_ID"),
)
births_out = threading.Event()
connect = edge._client.connect

def connect_and_tell(*args, callback, **kwargs):
    def then_tell(client):
        callback(client)
        births_out.set()
    connect(*args, callback=then_tell, **kwargs)

edge._client.connect = connect_and_tell
edge.connect(host, port=port, blocking=False)
if not births_out.wait(timeout=30):
    sys.exit("not connected")
edge.register(sp.Device(device_id="Pump", metrics=[
    sp.Metric(timestamp=now(), name="temp", datatype=sp.DataType.DOUBLE, value=20.0)]))
print("published", flush=True)
for line in sys.stdin:
    word, _, value = line.strip().partition(" ")
    if word == "data":
        edge.update_device(
            "Pump", [sp.Metric(timestamp=now(), name="temp", datatype=sp.DataType.DOUBLE,
                               value=float(value))])
        print("sent", flush=True)
    elif word == "disconnect":
        edge.disconnect()
        print("disconnected", flush=True)
        break
""".replace("CLIENT_ID", CLIENT_ID)


class Edge:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def line(self) -> bytes:
        assert self.process.stdout is not None
        async with asyncio.timeout(60):
            return (await self.process.stdout.readline()).strip()

    async def say(self, text: str) -> bytes:
        assert self.process.stdin is not None
        self.process.stdin.write(text.encode() + b"\n")
        await self.process.stdin.drain()
        return await self.line()


async def _start(port: int) -> Edge:
    process = await asyncio.create_subprocess_exec(
        str(pysparkplug_python()), "-c", EDGE, "127.0.0.1", str(port),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    edge = Edge(process)
    assert await edge.line() == b"published"
    return edge


async def _presence(db: asyncpg.Connection, device: str) -> str | None:
    value = await db.fetchval("SELECT presence FROM device WHERE device_id = $1", device)
    return None if value is None else str(value)


async def test_a_pysparkplug_edge_node_restarted_after_a_clean_stop_survives_a_reconnect(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=CONFIG)
    wire: list[tuple[str, int | None]] = []
    edges: list[Edge] = []
    async with (
        running_daemon(config) as daemon,
        aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="wire-trace") as trace,
    ):
        await trace.subscribe("spBv1.0/Plant2/+/Cell1", qos=0)

        async def read_wire() -> None:
            async for message in trace.messages:
                payload = sparkplug.decode_payload(bytes(message.payload))  # type: ignore[arg-type]
                wire.append((str(message.topic).split("/")[2], payload.bdseq()))

        def judged(kind: str, count: int) -> bool:
            return metric(daemon, "gateway_sparkplug_messages_total", {"type": kind}) >= count

        tracing = asyncio.create_task(read_wire())
        try:
            first = await _start(mosquitto.port)
            edges.append(first)
            await wait_until(lambda: judged("DBIRTH", 1), timeout=30, message="first births")
            assert await first.say("disconnect") == b"disconnected"
            await wait_until(lambda: judged("NDEATH", 1), timeout=30, message="clean NDEATH")
            assert await _presence(db, "Plant2/Cell1") == "offline"

            # Started again: its bdSeq from 0.
            second = await _start(mosquitto.port)
            edges.append(second)
            await wait_until(lambda: judged("DBIRTH", 2), timeout=30, message="second births")
            assert await _presence(db, "Plant2/Cell1") == "online"
            # Its connection taken over (a client of its id): the broker sends its Will, and
            # paho connects it again, with the births of its next bdSeq.
            async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier=CLIENT_ID):
                pass
            await wait_until(lambda: judged("NBIRTH", 3), timeout=60, message="reborn")
            await wait_until(lambda: judged("DBIRTH", 3), timeout=30, message="device reborn")
            traced = json.dumps(wire)
            assert await _presence(db, "Plant2/Cell1") == "online", f"wire: {traced}"
            assert await _presence(db, "Plant2/Cell1/Pump") == "online", f"wire: {traced}"
            assert await second.say("data 31.5") == b"sent"

            async def stored() -> bool:
                rows = await db.fetch(
                    "SELECT metrics->>'temp' FROM telemetry WHERE device_id = 'Plant2/Cell1/Pump'"
                )
                return "31.5" in [r[0] for r in rows]

            await wait_until(lambda: judged("DDATA", 1), timeout=30, message="DDATA judged")
            letters = await db.fetch("SELECT reason, detail FROM dead_letter")
            assert letters == [], f"wire: {traced}"
            await wait_until(stored, timeout=30, message="the DDATA stored")
        finally:
            tracing.cancel()
            await asyncio.gather(tracing, return_exceptions=True)
            for edge in edges:
                if edge.process.returncode is None:
                    edge.process.kill()
                    await edge.process.wait()
