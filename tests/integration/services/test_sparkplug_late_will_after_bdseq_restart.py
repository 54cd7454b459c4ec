"""An edge node that starts its bdSeq at 0 again in each process (pysparkplug, srad,
SparkplugNet, the demo's edge node) restarts while the host had session bdSeq 5 born; the Will
of that session is committed after the new session's NBIRTH (bdSeq 0) by another node of a
`$share` group. That Will was kept as the death of a session "not born yet" (5 is after 0), and
five reconnects later the edge node's NBIRTH with bdSeq 5 found its session dead: the node and
its devices offline while it served, until it reconnected again.

Only the next session's death (the birth's bdSeq + 1) can come before its own NBIRTH; one
further on is a late Will of an older session. Real PostgreSQL, batches through the ingest
store as two nodes of the group commit them."""

from __future__ import annotations

import asyncpg

from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.store import store
from gateway.sparkplug.host import SparkplugHost
from protocol import Encoding, Topics
from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType
from storage import sparkplug as repo

DECODER = MessageDecoder(Topics("iot"), Encoding.JSON, 65536, sparkplug=True)
T0 = 1767225600000


def _payload(seq: int | None, bdseq: int, ts: int) -> bytes:
    message = pb.Payload(timestamp=ts)
    if seq is not None:
        message.seq = seq
    metric = message.metrics.add()
    metric.name, metric.datatype, metric.long_value = "bdSeq", DataType.INT64, bdseq
    return message.SerializeToString()


async def _batch(pool: asyncpg.Pool, host: SparkplugHost, topic: str, body: bytes) -> None:
    batch = DECODER.classify([Inbound(topic=topic, payload=body)])
    async with pool.acquire() as conn, conn.transaction():
        await store(conn, batch, "test-node", sparkplug=host)


async def test_a_late_will_from_before_a_bdseq_restart_kills_no_later_session(
    pool: asyncpg.Pool,
) -> None:
    a, b = SparkplugHost(), SparkplugHost()
    await _batch(pool, a, "spBv1.0/G/NBIRTH/N", _payload(0, 5, T0))
    # The edge process restarts: bdSeq 0 again; its last session's Will is committed late.
    await _batch(pool, a, "spBv1.0/G/NBIRTH/N", _payload(0, 0, T0 + 1000))
    await _batch(pool, b, "spBv1.0/G/NDEATH/N", _payload(None, 5, T0))
    # It loses its link five times, each time its Will, then a new session's birth.
    for bdseq in range(1, 6):
        await _batch(pool, b, "spBv1.0/G/NDEATH/N", _payload(None, bdseq - 1, T0))
        await _batch(pool, a, "spBv1.0/G/NBIRTH/N", _payload(0, bdseq, T0 + 1000 * (bdseq + 1)))
    async with pool.acquire() as conn:
        node = await repo.get_node(conn, "G", "N")
    assert node is not None
    presence = await pool.fetchval("SELECT presence FROM device WHERE device_id = 'G/N'")
    assert (node.born, node.bdseq, presence) == (True, 5, "online"), (
        f"session 5 born and serving, taken for dead: born={node.born}, presence={presence}"
    )
