"""An edge node of PyPI's ``pysparkplug`` (0.6.1) that leaves cleanly (``EdgeNode.disconnect``)
goes offline, and so do its devices.

pysparkplug makes the Will of its *next* connection as soon as its births are out, and its
clean disconnect publishes an ``NDEATH`` with that bdSeq: one above its ``NBIRTH``'s (traced
here on the wire). The host took an ``NDEATH`` with a bdSeq after the birth in force only for
the Will of a session whose ``NBIRTH`` another node of a ``$share`` group still commits, and
left the node online until that birth: it never comes (the next session's bdSeq is one higher
again), so an edge node that stopped showed online, its devices too, and an ``inactivity`` rule
never raised ``presence offline``. A later session's death means the session in force is over
as well: an edge node holds one MQTT connection (one client id) at a time.

A real daemon, mosquitto and pysparkplug in its own venv (tests/support/sparkplug/.pyvenv)."""

from __future__ import annotations

import asyncio
import json

import aiomqtt
import asyncpg

from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.store import store
from gateway.sparkplug.host import SparkplugHost
from protocol import Encoding, Topics, sparkplug
from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType
from storage import sparkplug as repo
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.sparkplug_edge import pysparkplug_python
from tests.support.waiting import wait_until

DECODER = MessageDecoder(Topics("iot"), Encoding.JSON, 65536, sparkplug=True)
CONFIG = """
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["Plant2"]

[[rules]]
key = "cell-gone"
kind = "inactivity"
silent_seconds = 600
severity = "MAJOR"
devices = "Plant2/Cell1/Pump"
"""

# pysparkplug's edge node: births, one DDATA, then on a line on stdin its clean disconnect.
EDGE = """
import sys, threading
import pysparkplug as sp

host, port = sys.argv[1], int(sys.argv[2])
now = sp.get_current_timestamp
edge = sp.EdgeNode(
    group_id="Plant2", edge_node_id="Cell1",
    metrics=[sp.Metric(timestamp=now(), name="Firmware", datatype=sp.DataType.STRING, value="1.2")],
    client=sp.Client(client_id="pysparkplug-Plant2-Cell1"),
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
born = now()
edge.register(sp.Device(device_id="Pump", metrics=[
    sp.Metric(timestamp=born, name="temp", datatype=sp.DataType.DOUBLE, value=20.0)]))
temp = sp.Metric(timestamp=now(), name="temp", datatype=sp.DataType.DOUBLE, value=21.5)
edge.update_device("Pump", [temp])
print("published", flush=True)
sys.stdin.readline()
edge.disconnect()
print("disconnected", flush=True)
"""


async def _presence(db: asyncpg.Connection, device: str) -> str | None:
    value = await db.fetchval("SELECT presence FROM device WHERE device_id = $1", device)
    return None if value is None else str(value)


async def test_a_pysparkplug_edge_node_leaving_cleanly_goes_offline(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    python = pysparkplug_python()
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=CONFIG)
    bdseqs: dict[str, int | None] = {}
    async with (
        running_daemon(config) as daemon,
        aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="wire-trace") as trace,
    ):
        await trace.subscribe("spBv1.0/Plant2/+/Cell1", qos=0)

        async def read_wire() -> None:
            async for message in trace.messages:
                payload = sparkplug.decode_payload(bytes(message.payload))  # type: ignore[arg-type]
                bdseqs[str(message.topic).split("/")[2]] = payload.bdseq()

        tracing = asyncio.create_task(read_wire())
        process = await asyncio.create_subprocess_exec(
            str(python),
            "-c",
            EDGE,
            "127.0.0.1",
            str(mosquitto.port),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert process.stdout is not None
            assert process.stdin is not None
            async with asyncio.timeout(60):
                assert (await process.stdout.readline()).strip() == b"published"

            async def online() -> bool:
                return await _presence(db, "Plant2/Cell1/Pump") == "online"

            await wait_until(online, timeout=30, message="the pump born")
            assert await _presence(db, "Plant2/Cell1") == "online"

            process.stdin.write(b"disconnect\n")
            await process.stdin.drain()
            async with asyncio.timeout(60):
                assert (await process.stdout.readline()).strip() == b"disconnected"
            await wait_until(
                lambda: metric(daemon, "gateway_sparkplug_messages_total", {"type": "NDEATH"}) >= 1,
                timeout=30,
                message="the NDEATH of the clean disconnect judged",
            )
            await wait_until(lambda: "NDEATH" in bdseqs, timeout=30, message="NDEATH traced")
            wire = json.dumps(bdseqs, sort_keys=True)
            assert await _presence(db, "Plant2/Cell1") == "offline", f"bdSeq on the wire: {wire}"
            assert await _presence(db, "Plant2/Cell1/Pump") == "offline"

            async def gone() -> bool:
                rows = await db.fetch(
                    "SELECT a.rule_key, (SELECT e.payload->>'reason' FROM outbox_event e"
                    " WHERE e.aggregate_type = 'alarm' AND e.aggregate_id = a.id::text"
                    " AND e.event_type = 'alarm.created') AS reason"
                    " FROM alarm a WHERE a.device_id = 'Plant2/Cell1/Pump'"
                )
                return ("cell-gone", "presence offline") in [tuple(r) for r in rows]

            await wait_until(gone, timeout=60, message="the inactivity alarm raised")
        finally:
            tracing.cancel()
            await asyncio.gather(tracing, return_exceptions=True)
            if process.returncode is None:
                process.kill()
                await process.wait()


async def test_a_late_will_from_before_a_bdseq_restart_leaves_the_node_online(
    pool: asyncpg.Pool,
) -> None:
    """An edge node that starts its bdSeq at 0 in each process (pysparkplug, srad) restarts:
    the Will of its last session (bdSeq 5) is committed after its new NBIRTH (bdSeq 0) by
    another node of a `$share` group. That death is not the next session's: the node lives on."""
    host = SparkplugHost()

    async def batch(topic: str, body: bytes) -> None:
        classified = DECODER.classify([Inbound(topic=topic, payload=body)])
        async with pool.acquire() as conn, conn.transaction():
            await store(conn, classified, "test-node", sparkplug=host)

    def payload(seq: int | None, bdseq: int) -> bytes:
        message = pb.Payload(timestamp=1767225600000)
        if seq is not None:
            message.seq = seq
        metric = message.metrics.add()
        metric.name, metric.datatype, metric.long_value = "bdSeq", DataType.INT64, bdseq
        return message.SerializeToString()

    await batch("spBv1.0/G/NBIRTH/N", payload(0, 5))
    await batch("spBv1.0/G/NBIRTH/N", payload(0, 0))  # restarted, bdSeq from 0 again
    await batch("spBv1.0/G/NDEATH/N", payload(None, 5))  # the old session's Will, late
    presence = await pool.fetchval("SELECT presence FROM device WHERE device_id = 'G/N'")
    assert presence == "online"
    async with pool.acquire() as conn:
        node = await repo.get_node(conn, "G", "N")
    assert node is not None
    assert node.born
