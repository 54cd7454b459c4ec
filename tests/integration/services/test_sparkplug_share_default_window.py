"""Nodes of a ``$share`` group ([mqtt] shared_group) with Sparkplug on and ``[sparkplug]
reorder_window_s`` left out: each node takes part of an edge node's stream and commits it
concurrently, so a seq regularly commits before the one that precedes it. With the window at
its old default, 0, each such reorder was a gap: the edge node untrusted (its data not judged)
and a rebirth request, again at each reorder after the rebirth (a rebirth about every second
per busy edge node). Unset, the window is now a few seconds in a shared group (0 alone).

The two nodes are two hosts built as the daemon builds them (``live_path.sparkplug_host``) from
the configuration, each batch stored through the ingest store on a real PostgreSQL; the reorder
is forced (seq 3 committed before seq 2), as a busy group meets it."""

from __future__ import annotations

import asyncpg

from gateway.ingest import live_path
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.store import store
from gateway.sparkplug.host import SparkplugHost
from protocol import Encoding, Topics
from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType
from storage import sparkplug as repo
from tests.support.daemon import make_config

DECODER = MessageDecoder(Topics("iot"), Encoding.JSON, 65536, sparkplug=True)
SPARKPLUG = """
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["G"]
"""


def _payload(seq: int, *metrics: dict[str, object]) -> bytes:
    message = pb.Payload(timestamp=1767225600000 + seq, seq=seq)
    for fields in metrics:
        metric = message.metrics.add()
        for key, value in fields.items():
            setattr(metric, key, value)
    return message.SerializeToString()


async def _batch(pool: asyncpg.Pool, host: SparkplugHost, topic: str, body: bytes) -> None:
    batch = DECODER.classify([Inbound(topic=topic, payload=body)])
    async with pool.acquire() as conn, conn.transaction():
        await store(conn, batch, "test-node", sparkplug=host)


async def test_a_share_group_without_a_window_set_takes_a_reorder_for_no_gap(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    config = make_config(
        dsn=db_dsn, mqtt_port=1883, extra=SPARKPLUG, mqtt_extra='shared_group = "sp"'
    )
    one, two = live_path.sparkplug_host(config), live_path.sparkplug_host(config)
    assert one is not None
    assert two is not None
    bdseq = {"name": "bdSeq", "datatype": DataType.INT64, "long_value": 1}
    temp = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}
    await _batch(pool, one, "spBv1.0/G/NBIRTH/N", _payload(0, bdseq))
    await _batch(pool, two, "spBv1.0/G/DBIRTH/N/D", _payload(1, temp))
    # Node two commits seq 3 while node one still commits seq 2.
    await _batch(pool, two, "spBv1.0/G/DDATA/N/D", _payload(3, {"alias": 1, "double_value": 3.0}))
    await _batch(pool, one, "spBv1.0/G/DDATA/N/D", _payload(2, {"alias": 1, "double_value": 2.0}))
    async with pool.acquire() as conn:
        node = await repo.get_node(conn, "G", "N")
    assert node is not None
    assert node.trusted, node.rebirth_reason
    assert node.rebirth_wanted_at is None
    assert node.seq == 3


async def test_a_node_alone_judges_a_skipped_seq_at_once(pool: asyncpg.Pool, db_dsn: str) -> None:
    """Without a shared group nothing reorders a node's stream: unset, the window is 0."""
    config = make_config(dsn=db_dsn, mqtt_port=1883, extra=SPARKPLUG)
    host = live_path.sparkplug_host(config)
    assert host is not None
    assert host.reorder_window_s == 0
