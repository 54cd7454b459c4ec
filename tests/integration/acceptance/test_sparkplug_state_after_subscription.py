"""The host's STATE birth comes only once the node is subscribed to the Sparkplug topics
(Sparkplug 3.0, tck-id-host-topic-phid-birth-sub-required / -birth-required): an edge node
configured with this host as its primary host (Ignition's MQTT Transmission, Cirrus Link's
modules, ...) waits for the online STATE and answers it at once with its NBIRTH and DBIRTHs, at
QoS 0. Published while the ingest session was still connecting or subscribing, the STATE sent
the births into a broker that had nobody to give them to: lost, and every message after them
a dead letter SPARKPLUG_NOT_BORN until a rebirth request came round.

The interleaving is forced: the test holds a lock on ``mqtt_subscription`` that the session
takes before it subscribes (storage/queries/subscriptions.sql remember_subscriptions), so the
session provably waits while the host's STATE link would speak. The edge node is the test's
own MQTT client (neither Tahu's JavaScript client nor pysparkplug waits for a primary host),
its payloads built with the vendored Sparkplug schema."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiomqtt
import asyncpg
from structlog.testing import capture_logs

from gateway.runtime.daemon import Daemon
from protocol import sparkplug
from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType
from storage import sparkplug as repo
from tests.support.daemon import READY_TIMEOUT_S, make_config
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

SPARKPLUG = """
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["Plant1"]
"""
MS = 1767225600000


def _payload(seq: int, *metrics: dict[str, object]) -> bytes:
    message = pb.Payload(timestamp=MS + seq, seq=seq)
    for fields in metrics:
        metric = message.metrics.add()
        for key, value in fields.items():
            setattr(metric, key, value)
    return message.SerializeToString()


BIRTHS = [
    (
        "spBv1.0/Plant1/NBIRTH/Line4",
        _payload(0, {"name": "bdSeq", "datatype": DataType.INT64, "long_value": 1}),
    ),
    (
        "spBv1.0/Plant1/DBIRTH/Line4/Oven",
        _payload(1, {"name": "temp", "alias": 10, "datatype": DataType.DOUBLE, "double_value": 1}),
    ),
]
DATA = ("spBv1.0/Plant1/DDATA/Line4/Oven", _payload(2, {"alias": 10, "double_value": 2.0}))


async def _lock_waiters(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                " WHERE c.relname = 'mqtt_subscription' AND NOT l.granted"
                " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        )
    finally:
        await conn.close()


async def test_an_edge_node_answering_the_hosts_birth_is_heard(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG, log_level="info")
    births_sent = asyncio.Event()

    async def primary_host_edge_node(client: aiomqtt.Client) -> None:
        """Births at QoS 0 at the host's online STATE (and again at each one after)."""
        async for message in client.messages:
            state = sparkplug.parse_state(bytes(message.payload))  # type: ignore[arg-type]
            if state is not None and state[0] and not births_sent.is_set():
                for topic, body in BIRTHS:
                    await client.publish(topic, body, qos=0)
                births_sent.set()

    holder = await asyncpg.connect(db_dsn)
    held = holder.transaction()
    await held.start()
    await holder.execute("LOCK TABLE mqtt_subscription IN ACCESS EXCLUSIVE MODE")
    stop = asyncio.Event()
    daemon = Daemon(config)
    async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="edge-Line4") as edge:
        await edge.subscribe(sparkplug.state_topic("gw-host"), qos=1)
        answering = asyncio.create_task(primary_host_edge_node(edge))
        with capture_logs() as logs:
            running = asyncio.create_task(daemon.run(stop))
            try:
                # The session waits on the lock, before its SUBSCRIBE.
                await wait_until(
                    lambda: _lock_waiters(db_dsn), message="the session waiting to subscribe"
                )

                def decided() -> bool:
                    # Either the host spoke (and the edge node answered), or it says it waits.
                    waiting = any(e["event"] == "sparkplug_state_waits_for_ingest" for e in logs)
                    return births_sent.is_set() or waiting

                await wait_until(decided, message="the host's STATE link deciding")
                await held.rollback()
                await holder.close()
                async with asyncio.timeout(READY_TIMEOUT_S):
                    await daemon.ready.wait()
                async with asyncio.timeout(30):
                    await births_sent.wait()
                await edge.publish(*DATA, qos=1)

                conn = await asyncpg.connect(db_dsn)
                try:

                    async def data_judged() -> bool:
                        letters = await conn.fetchval("SELECT count(*) FROM dead_letter")
                        rows = await conn.fetch(
                            "SELECT metrics::text FROM telemetry"
                            " WHERE device_id = 'Plant1/Line4/Oven'"
                        )
                        return letters > 0 or {"temp": 2.0} in [json.loads(r[0]) for r in rows]

                    await wait_until(data_judged, message="the DDATA after the births judged")
                    letters = await conn.fetch("SELECT topic, reason FROM dead_letter ORDER BY id")
                    node = await repo.get_node(conn, "Plant1", "Line4")
                finally:
                    await conn.close()
            finally:
                stop.set()
                async with asyncio.timeout(60):
                    await running
                answering.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await answering
    # The births answering the host's STATE were heard: the node is born, its data judged.
    assert [dict(r) for r in letters] == []
    assert node is not None
    assert node.born
    assert node.trusted, node.rebirth_reason
