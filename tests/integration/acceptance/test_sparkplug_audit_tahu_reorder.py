"""Eclipse Tahu's JavaScript edge node (npm ``sparkplug-client`` 3.2.4) through a real
mosquitto, its messages as published split between the two nodes of a ``$share`` group and
committed in another order than their seqs (the order forced by the test, each node's host in
this process, as test_sparkplug_audit_device_death_order.py), against real PostgreSQL:

- a device's ``DDATA`` committed after its ``DDEATH`` is that birth's data: stored (it was a
  dead letter ``SPARKPLUG_NOT_BORN`` and a rebirth request);
- after a rebirth that moves alias 1 (Tahu sends data by alias alone, starts its seq again at 0
  with each ``NBIRTH`` and keeps bdSeq 0), the new session's ``DDATA`` committed before its
  births is a dead letter ``SPARKPLUG_SESSION_UNKNOWN`` (it was stored as the old metric), and
  replayed once the births are stored it is the new metric."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiomqtt
import asyncpg

from gateway.ingest import live_path
from gateway.ingest.decoder import Inbound
from gateway.ingest.replay import pending_ids, replay
from gateway.ingest.store import StoreResult, store
from gateway.sparkplug.host import SparkplugHost
from gateway.support.metrics import Metrics
from tests.integration.services.test_sparkplug_host import DECODER
from tests.support.daemon import make_config
from tests.support.mosquitto import Mosquitto
from tests.support.sparkplug_edge import EdgeNode, edge_node
from tests.support.waiting import wait_until

EXTRA = '[sparkplug]\nenabled = true\nhost_id = "gw-host"\ngroups = ["G"]\n'
NODE_METRICS = [{"name": "Uptime", "alias": 100, "type": "Int64", "value": 7}]

Wire = list[tuple[str, bytes]]


def _birth(metric: str) -> list[dict[str, object]]:
    return [{"name": metric, "alias": 1, "type": "Double", "value": 1.0}]


def _by_alias(value: float) -> list[dict[str, object]]:
    return [{"alias": 1, "type": "Double", "value": value}]


@contextlib.asynccontextmanager
async def _tahu(port: int) -> AsyncIterator[tuple[EdgeNode, Wire]]:
    """Tahu's edge node G/N, and the messages it published, in order, as the broker sent them."""
    wire: Wire = []

    async def watch(client: aiomqtt.Client) -> None:
        async for message in client.messages:
            wire.append((str(message.topic), bytes(message.payload)))  # type: ignore[arg-type]

    async with aiomqtt.Client("127.0.0.1", port) as watcher:
        await watcher.subscribe("spBv1.0/G/+/N/#", qos=1)
        await watcher.subscribe("spBv1.0/G/+/N", qos=1)
        watching = asyncio.create_task(watch(watcher))
        try:
            async with edge_node(port, "G", "N") as edge:
                yield edge, wire
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching


async def _published(
    edge: EdgeNode, wire: Wire, count: int, *ops: tuple[str, dict[str, object]]
) -> None:
    for op, fields in ops:
        await edge.send(op, **fields)
    await wait_until(lambda: len(wire) >= count, message=f"{count} messages on the wire")


async def _commit(pool: asyncpg.Pool, host: SparkplugHost, messages: Wire) -> StoreResult:
    batch = DECODER.classify([Inbound(topic=t, payload=p) for t, p in messages])
    async with pool.acquire() as conn, conn.transaction():
        return await store(conn, batch, "test-node", sparkplug=host)


async def _samples(pool: asyncpg.Pool) -> list[dict[str, object]]:
    rows = await pool.fetch(
        "SELECT metrics::text FROM telemetry WHERE device_id = 'G/N/D' ORDER BY ts"
    )
    return [json.loads(row[0]) for row in rows]


async def test_tahu_device_data_committed_after_its_death_is_stored(
    pool: asyncpg.Pool, mosquitto: Mosquitto
) -> None:
    async with _tahu(mosquitto.port) as (edge, wire):
        await _published(
            edge,
            wire,
            4,
            ("nbirth", {"metrics": NODE_METRICS}),
            ("dbirth", {"device": "D", "metrics": _birth("temp")}),
            ("ddata", {"device": "D", "metrics": _by_alias(7.0)}),
            ("ddeath", {"device": "D"}),
        )
    nbirth, dbirth, ddata, ddeath = wire[:4]
    assert "DDATA" in ddata[0]
    assert "DDEATH" in ddeath[0]
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _commit(pool, host_a, [nbirth, dbirth])
    await _commit(pool, host_a, [ddeath])

    result = await _commit(pool, host_b, [ddata])

    assert [d.reason for d in result.dead_letters] == [], "the birth's data refused"
    assert {"temp": 7.0} in await _samples(pool)
    presence = await pool.fetchval("SELECT presence FROM device WHERE device_id = 'G/N/D'")
    assert presence == "offline"


async def test_tahu_rebirth_data_committed_before_its_births_waits_for_them(
    pool: asyncpg.Pool, db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with _tahu(mosquitto.port) as (edge, wire):
        await _published(
            edge,
            wire,
            7,
            ("nbirth", {"metrics": NODE_METRICS}),
            ("dbirth", {"device": "D", "metrics": _birth("temp")}),
            ("ddata", {"device": "D", "metrics": _by_alias(7.0)}),
            ("ddata", {"device": "D", "metrics": _by_alias(7.5)}),
            # A rebirth that gives alias 1 to another metric.
            ("nbirth", {"metrics": NODE_METRICS}),
            ("dbirth", {"device": "D", "metrics": _birth("pressure")}),
            ("ddata", {"device": "D", "metrics": _by_alias(8.0)}),
        )
    old, (nbirth, dbirth, new) = wire[:4], wire[4:7]
    assert "NBIRTH" in nbirth[0]
    assert "DDATA" in new[0]
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _commit(pool, host_a, old)

    result = await _commit(pool, host_b, [new])

    assert {"temp": 8.0} not in await _samples(pool), "read with the old session's aliases"
    assert [d.reason for d in result.dead_letters] == ["SPARKPLUG_SESSION_UNKNOWN"]
    await _commit(pool, host_a, [nbirth, dbirth])
    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, extra=EXTRA), Metrics())
    outcomes = await replay(pool, path, await pending_ids(pool, "SPARKPLUG_SESSION_UNKNOWN"))
    assert [(o.outcome, o.succeeded) for o in outcomes] == [("stored", True)]
    assert {"pressure": 8.0} in await _samples(pool)
