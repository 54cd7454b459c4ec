"""Data of an edge node's session before its latest `NBIRTH`, committed after that birth by
another node of a `$share` group, is not read with the new session's aliases.

The edge node sends `DDATA` (alias 1, `temp`), then starts a new session whose births give
alias 1 to another metric (`pressure`): the seq starts again at 0 with the `NBIRTH`, so the old
`DDATA` (seq 2), committed after the new `NBIRTH` (seq 0) and `DBIRTH` (seq 1), looked like the
new session's next message and was stored, and judged, as `pressure`; and it moved the seq, so
that the new session's own seq 2 was taken for a reset (the node untrusted). A data message
published before the birth in force (its payload timestamp older than the `NBIRTH`'s), within
the reorder window of that birth, is a dead letter `SPARKPLUG_OLD_SESSION`, its bytes kept,
moving nothing of the stream.

Real PostgreSQL and the ingest store, the two nodes' hosts side by side (as
test_sparkplug_rebirth_reorder_presence.py)."""

from __future__ import annotations

import json

import asyncpg

from gateway.sparkplug.host import SparkplugHost
from protocol.sparkplug import DataType
from tests.integration.services.test_sparkplug_host import (
    DEVICE,
    NODE,
    _batch,
    _bdseq,
    _payload,
    _state,
    _temp,
)

T0 = 1767225600000


def _births(bdseq: int, metric: str, ts: int) -> list[tuple[str, str, bytes]]:
    birth = {"name": metric, "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}
    return [
        ("NBIRTH", NODE, _payload(0, _bdseq(bdseq), ts=ts)),
        ("DBIRTH", DEVICE, _payload(1, birth, ts=ts)),
    ]


async def _samples(pool: asyncpg.Pool) -> list[dict[str, object]]:
    rows = await pool.fetch(
        "SELECT metrics::text FROM telemetry WHERE device_id = 'G/N/D' ORDER BY ts"
    )
    return [json.loads(row[0]) for row in rows]


async def test_old_session_data_committed_after_the_new_birth_is_not_read_with_its_aliases(
    pool: asyncpg.Pool,
) -> None:
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _batch(pool, host_a, _births(0, "temp", T0))
    # The old session's DDATA (seq 2, temp 7.0) is host B's; host A commits the new session's
    # births (alias 1 is pressure now) first.
    old = ("DDATA", DEVICE, _payload(2, _temp(7.0), ts=T0 + 5000))
    await _batch(pool, host_a, _births(1, "pressure", T0 + 10_000))
    result = await _batch(pool, host_b, [old])
    assert {"pressure": 7.0} not in await _samples(pool), "old data read with the new aliases"
    assert [(d.reason, d.payload) for d in result.dead_letters] == [
        ("SPARKPLUG_OLD_SESSION", old[2])
    ]
    state = await _state(pool)
    assert state.seq == 1
    assert state.trusted
    # The new session's own seq 2 is in order: stored as pressure, the node trusted.
    new = ("DDATA", DEVICE, _payload(2, _temp(8.0), ts=T0 + 11_000))
    result = await _batch(pool, host_b, [new])
    assert result.dead_letters == ()
    assert {"pressure": 8.0} in await _samples(pool)
    assert (await _state(pool)).trusted
