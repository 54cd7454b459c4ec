"""A rebirth split between two nodes of a `$share` group: the edge node sends its `NBIRTH`, its
devices' `DBIRTH`s and its data in that order, and one node commits the `NBIRTH`, the first
`DBIRTH` and a `DDATA` while the other still commits the second device's `DBIRTH` (its seq is
missing there, within the reorder window). The data ended the births at once: the second device,
of the session before and about to be born again, was set offline, and an inactivity pass in
between raised "presence offline" for a device that never went away (the page for nothing that
migration 0050 ended for births committed apart). The births are over at a data message only
when no seq before it is missing: the missing one may be a `DBIRTH`.

Real PostgreSQL and the ingest store, the two nodes' hosts side by side (as
test_sparkplug_host.py's `$share` cases)."""

from __future__ import annotations

import asyncpg

from gateway.sparkplug.host import SparkplugHost
from protocol.sparkplug import DataType
from tests.integration.services.test_sparkplug_host import (
    NODE,
    _batch,
    _bdseq,
    _payload,
    _presence,
)

D1 = "spBv1.0/G/{}/N/D1"
D2 = "spBv1.0/G/{}/N/D2"


def _births(ts: int) -> list[tuple[str, str, bytes]]:
    one = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}
    two = {"name": "temp", "alias": 2, "datatype": DataType.DOUBLE, "double_value": 2.0}
    return [
        ("NBIRTH", NODE, _payload(0, _bdseq(3), ts=ts)),
        ("DBIRTH", D1, _payload(1, one, ts=ts)),
        ("DBIRTH", D2, _payload(2, two, ts=ts)),
    ]


async def test_data_overtaking_a_dbirth_of_the_rebirth_sets_no_device_offline(
    pool: asyncpg.Pool,
) -> None:
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    t0 = 1767225600000
    await _batch(pool, host_a, _births(t0))
    assert await _presence(pool, "G/N/D2") == "online"
    # The rebirth: host A commits the NBIRTH, D1's DBIRTH and D1's data (seq 3); D2's DBIRTH
    # (seq 2) is host B's, committed after.
    nbirth, dbirth_1, dbirth_2 = _births(t0 + 60_000)
    data = ("DDATA", D1, _payload(3, {"alias": 1, "double_value": 1.5}, ts=t0 + 61_000))
    await _batch(pool, host_a, [nbirth, dbirth_1, data])
    assert await _presence(pool, "G/N/D2") == "online", "D2 offline between its births"
    await _batch(pool, host_b, [dbirth_2])
    assert await _presence(pool, "G/N/D2") == "online"
    # The births are over at the next data in order: a device no DBIRTH bore is offline then.
    nbirth, dbirth_1, _ = _births(t0 + 120_000)
    await _batch(pool, host_a, [nbirth, dbirth_1])
    await _batch(pool, host_b, [("NDATA", NODE, _payload(2, ts=t0 + 121_000))])
    assert await _presence(pool, "G/N/D2") == "offline"
    assert await _presence(pool, "G/N/D1") == "online"
