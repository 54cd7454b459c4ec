"""A device's `DBIRTH` and `DDEATH` split between two nodes of a `$share` group and committed
in the other order than their seqs: the later-sequenced one is what the device is.

The edge node births a device (seq 1) and its device dies (seq 2): when the node holding the
`DDEATH` commits first (the `DBIRTH`'s seq is missing there, within the reorder window), the
`DBIRTH` committed after it set the device online again, for good with an edge node that does
not answer rebirth requests (pysparkplug): the device was gone, its presence said online. The
other way round (a device dies, seq 2, and is born again, seq 3), the late `DDEATH` set the device
born again offline, and its data after that was a dead letter. The device's last birth or death
taken while a seq before it is missing is kept (migration 0059), and a late message older than
it in seq order changes neither the device's presence nor its births.

Real PostgreSQL and the ingest store, the two nodes' hosts side by side (as
test_sparkplug_rebirth_reorder_presence.py)."""

from __future__ import annotations

import asyncpg

from gateway.sparkplug.host import SparkplugHost
from protocol.sparkplug import DataType
from tests.integration.services.test_sparkplug_host import (
    DEVICE,
    NODE,
    _batch,
    _bdseq,
    _payload,
    _presence,
    _state,
    _temp,
)

T0 = 1767225600000
TEMP = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}


async def test_a_ddeath_committed_before_its_own_dbirth_leaves_the_device_offline(
    pool: asyncpg.Pool,
) -> None:
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _batch(pool, host_a, [("NBIRTH", NODE, _payload(0, _bdseq(0), ts=T0))])
    # The device is born (seq 1, host A's) and dies (seq 2, host B's, committed first).
    await _batch(pool, host_b, [("DDEATH", DEVICE, _payload(2, ts=T0 + 2000))])
    assert await _presence(pool, "G/N/D") == "offline"
    await _batch(pool, host_a, [("DBIRTH", DEVICE, _payload(1, TEMP, ts=T0 + 1000))])
    assert await _presence(pool, "G/N/D") == "offline", "the DBIRTH older than the DDEATH won"
    state = await _state(pool)
    assert state.devices == []
    # No seq is missing any more: the node is followed, nothing to ask a rebirth for.
    assert state.trusted
    assert state.rebirth_reason is None
    # Its next birth (in order) is the device's again.
    await _batch(pool, host_b, [("DBIRTH", DEVICE, _payload(3, TEMP, ts=T0 + 3000))])
    assert await _presence(pool, "G/N/D") == "online"


async def test_a_ddeath_committed_after_the_dbirth_that_follows_it_leaves_the_device_online(
    pool: asyncpg.Pool,
) -> None:
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _batch(
        pool,
        host_a,
        [
            ("NBIRTH", NODE, _payload(0, _bdseq(0), ts=T0)),
            ("DBIRTH", DEVICE, _payload(1, TEMP, ts=T0)),
        ],
    )
    # The device dies (seq 2, host B's) and is born again (seq 3, host A's, committed first).
    await _batch(pool, host_a, [("DBIRTH", DEVICE, _payload(3, TEMP, ts=T0 + 3000))])
    await _batch(pool, host_b, [("DDEATH", DEVICE, _payload(2, ts=T0 + 2000))])
    assert await _presence(pool, "G/N/D") == "online", "the DDEATH older than the DBIRTH won"
    state = await _state(pool)
    assert state.devices == ["D"]
    # Its data is read with the birth in force.
    result = await _batch(pool, host_b, [("DDATA", DEVICE, _payload(4, _temp(7.0), ts=T0 + 4000))])
    assert result.dead_letters == ()
    assert result.stored == 1
    assert (await _state(pool)).trusted
