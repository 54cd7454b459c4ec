"""The rebirth loop's expiry of missing seqs (``expire_missing``: a seq missing longer than the
reorder window, no message can fill it now) drops the devices' marks with them, as it drops
their lives (migration 0062) and as a host's own expiry does.

It left ``device_marks``: the device's latest birth or death taken while a seq was missing,
outliving the seqs it was judged against. ``_overtaken`` reads a mark in seq order against the
node's seq, which holds only while the mark is younger than the reorder window (no seq passes it
by 256 meanwhile). Once seqs went missing again after the expiry, the stream moving on a cycle
past the stale mark made this cycle's late DBIRTH look older than that mark: "overtaken", the
device left offline, its data dead letters until the edge node was born again.

Real PostgreSQL and the ingest store, two nodes' hosts side by side (as
test_sparkplug_audit_device_death_order.py); the rebirth loop's statement run as the loop runs
it, the missing seq's time set back past the window (the test does not wait a window)."""

from __future__ import annotations

import asyncpg

from gateway.sparkplug.host import SparkplugHost
from protocol.sparkplug import DataType
from storage import sparkplug as repo
from tests.integration.services.test_sparkplug_host import (
    DEVICE,
    NODE,
    _batch,
    _bdseq,
    _payload,
    _presence,
    _state,
)

T0 = 1767225600000
WINDOW_S = 60.0
TEMP = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}


def _ndata(seq: int, second: int) -> tuple[str, str, bytes]:
    return ("NDATA", NODE, _payload(seq, ts=T0 + 1000 * second))


async def test_a_late_dbirth_after_the_missing_seqs_expired_is_not_judged_by_an_old_mark(
    pool: asyncpg.Pool,
) -> None:
    host_a = SparkplugHost(reorder_window_s=WINDOW_S)
    host_b = SparkplugHost(reorder_window_s=WINDOW_S)
    await _batch(
        pool,
        host_a,
        [
            ("NBIRTH", NODE, _payload(0, _bdseq(0), ts=T0)),
            ("DBIRTH", DEVICE, _payload(1, TEMP, ts=T0)),
        ],
    )
    # The device dies at seq 3 while seq 2 is missing (another node's, never committed): its
    # mark is 3.
    await _batch(pool, host_a, [("DDEATH", DEVICE, _payload(3, ts=T0 + 3000))])
    assert await _presence(pool, "G/N/D") == "offline"
    # Seq 2 stays missing past the window: the rebirth loop gives it up.
    async with pool.acquire() as conn:
        await conn.execute(
            "UPDATE sparkplug_node SET missing = (SELECT jsonb_object_agg(k, v::float8 - $1)"
            " FROM jsonb_each_text(missing) AS m(k, v)) WHERE missing <> '{}'::jsonb",
            2 * WINDOW_S,
        )
        assert await repo.expire_missing(conn, WINDOW_S) == [("G", "N")]
    # The stream goes on, a cycle on to seq 3 again, seqs missing all along (other nodes'
    # messages, not committed yet): 4..99, 101..199, then 201..255 and 0..2, this cycle's
    # seq 2 among them.
    await _batch(pool, host_a, [_ndata(100, 100), _ndata(200, 200), _ndata(3, 259)])
    # This cycle's seq 2, committed late by the other node: the device born again.
    await _batch(pool, host_b, [("DBIRTH", DEVICE, _payload(2, TEMP, ts=T0 + 258_000))])
    assert await _presence(pool, "G/N/D") == "online", "judged by the mark of the cycle before"
    assert (await _state(pool)).devices == ["D"]
