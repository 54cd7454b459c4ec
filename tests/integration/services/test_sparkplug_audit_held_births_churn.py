"""Edge nodes churn (renamed, replaced, a publisher with a random node name): the births a
host holds between batches stay within HELD_BIRTHS however many nodes it has met, nodes whose
births hold nothing (never born, or born with no metric) included."""

from __future__ import annotations

import tracemalloc

import asyncpg
import msgspec

from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.store import store
from gateway.sparkplug import host as host_module
from gateway.sparkplug.host import SparkplugHost
from protocol import Encoding, Topics
from protocol import sparkplug_b_pb2 as pb

DECODER = MessageDecoder(Topics("iot"), Encoding.JSON, 65536, sparkplug=True)
NODES = 60_000  # more than HELD_BIRTHS
BATCH = 2_000


def _ndata(seq: int) -> bytes:
    message = pb.Payload(timestamp=1767225600000, seq=seq)
    metric = message.metrics.add()
    metric.alias = 1
    metric.double_value = 1.0
    return message.SerializeToString()


async def test_nodes_met_once_are_not_all_held(pool: asyncpg.Pool) -> None:
    host = SparkplugHost()
    body = _ndata(1)
    for first in range(0, NODES, BATCH):
        items = [
            Inbound(topic=f"spBv1.0/G/NDATA/churn-{n:06d}", payload=body)
            for n in range(first, first + BATCH)
        ]
        async with pool.acquire() as conn, conn.transaction():
            result = await store(conn, DECODER.classify(items), "test-node", sparkplug=host)
        assert result.sparkplug is not None
        host.committed(result.sparkplug)
    assert await pool.fetchval("SELECT count(*) FROM sparkplug_node") == NODES
    held = len(host._births)
    # Each node held costs at least its key, its token and two dicts (~0.4 KB): 60,000 of
    # them ~24 MB on a host that promises ~8 MB for all it holds.
    assert held <= host_module.HELD_BIRTHS // 3, held
    assert held > 0  # still held: the next batch of a node met lately sends no births

    # The least recently met are forgotten, never guessed: read again from the row.
    items = [Inbound(topic="spBv1.0/G/NDATA/churn-000000", payload=_ndata(2))]
    async with pool.acquire() as conn, conn.transaction():
        result = await store(conn, DECODER.classify(items), "test-node", sparkplug=host)
    assert result.sparkplug is not None
    assert [letter.reason for letter in result.sparkplug.dead_letters] == ["SPARKPLUG_NOT_BORN"]


def test_a_held_node_is_counted_at_what_it_costs() -> None:
    """HELD_BIRTHS is documented as ~0.16 KB an entry (~8 MB in all): what a node with
    nothing born holds must be counted at least at that rate."""
    host = SparkplugHost()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(5_000):
            host._hold(
                ("G", f"churn-{n:06d}"),
                host_module._Births(
                    f"{n + 1}@7345987345987", msgspec.json.decode(b"{}"), msgspec.json.decode(b"{}")
                ),
            )
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(host._births) == 5_000
    assert used <= host._births_size * 160, (used, host._births_size)
