"""Data a device sent between its `DBIRTH` and its `DDEATH`, committed after the `DDEATH` by a
slower node of a `$share` group, is the device's data of that birth.

The edge node births a device (seq 1), sends its `DDATA` (seq 2, held by host B) and the device
dies (seq 3, host A's, committed first: seq 2 is missing there, within the reorder window). The
late `DDATA` found the device offline and was a dead letter `SPARKPLUG_NOT_BORN` (a rebirth
asked for, an operator to replay it): it was valid data, published while the device was born,
read with that birth's aliases. It is stored at its own time; the device stays offline. The
device's last life taken while a seq was missing (its `DBIRTH` seq, the `DDEATH` that ended
it) tells it apart from data of a device that was not born at its seq, or whose aliases a newer
birth has replaced: those stay dead letters.

Real PostgreSQL and the ingest store, the two nodes' hosts side by side (as
test_sparkplug_audit_device_death_order.py)."""

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
    _presence,
    _state,
    _temp,
)

T0 = 1767225600000


def _metric(name: str) -> dict[str, object]:
    return {"name": name, "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}


async def _samples(pool: asyncpg.Pool) -> list[tuple[int, dict[str, object]]]:
    rows = await pool.fetch(
        "SELECT (extract(epoch FROM ts) * 1000)::bigint, metrics::text FROM telemetry"
        " WHERE device_id = 'G/N/D' ORDER BY ts"
    )
    return [(row[0], json.loads(row[1])) for row in rows]


async def test_data_of_a_born_device_committed_after_its_death_is_stored(
    pool: asyncpg.Pool,
) -> None:
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _batch(
        pool,
        host_a,
        [
            ("NBIRTH", NODE, _payload(0, _bdseq(0), ts=T0)),
            ("DBIRTH", DEVICE, _payload(1, _metric("temp"), ts=T0)),
        ],
    )
    late = ("DDATA", DEVICE, _payload(2, _temp(7.0), ts=T0 + 2000))
    await _batch(pool, host_a, [("DDEATH", DEVICE, _payload(3, ts=T0 + 3000))])
    assert await _presence(pool, "G/N/D") == "offline"

    result = await _batch(pool, host_b, [late])

    assert [d.reason for d in result.dead_letters] == [], "valid data of the birth refused"
    assert (T0 + 2000, {"temp": 7.0}) in await _samples(pool)
    assert await _presence(pool, "G/N/D") == "offline"
    state = await _state(pool)
    assert state.devices == []
    assert state.trusted
    assert state.rebirth_reason is None


async def test_late_data_of_a_life_a_newer_birth_replaced_is_not_read_with_its_aliases(
    pool: asyncpg.Pool,
) -> None:
    """Born (seq 1, alias 1 temp), data (seq 2, late), dead (seq 3), born again with alias 1
    another metric (seq 4), dead (seq 5): the late data's aliases are gone."""
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _batch(
        pool,
        host_a,
        [
            ("NBIRTH", NODE, _payload(0, _bdseq(0), ts=T0)),
            ("DBIRTH", DEVICE, _payload(1, _metric("temp"), ts=T0)),
        ],
    )
    late = ("DDATA", DEVICE, _payload(2, _temp(7.0), ts=T0 + 2000))
    await _batch(
        pool,
        host_a,
        [
            ("DDEATH", DEVICE, _payload(3, ts=T0 + 3000)),
            ("DBIRTH", DEVICE, _payload(4, _metric("pressure"), ts=T0 + 4000)),
            ("DDEATH", DEVICE, _payload(5, ts=T0 + 5000)),
        ],
    )

    result = await _batch(pool, host_b, [late])

    assert [(d.reason, d.payload) for d in result.dead_letters] == [("SPARKPLUG_NOT_BORN", late[2])]
    assert all(m != {"pressure": 7.0} for _, m in await _samples(pool))
    assert await _presence(pool, "G/N/D") == "offline"


async def test_late_data_with_a_seq_before_it_still_missing_is_not_read(
    pool: asyncpg.Pool,
) -> None:
    """Born before the gap (seq 1); seqs 2 (held elsewhere: it may be a death and a birth with
    other aliases, for all this host knows) and 3 missing; 3 comes before 2, the device dead at
    4: seq 3's birth in force is not known yet."""
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _batch(
        pool,
        host_a,
        [
            ("NBIRTH", NODE, _payload(0, _bdseq(0), ts=T0)),
            ("DBIRTH", DEVICE, _payload(1, _metric("temp"), ts=T0)),
        ],
    )
    await _batch(pool, host_a, [("DDEATH", DEVICE, _payload(4, ts=T0 + 4000))])
    late = ("DDATA", DEVICE, _payload(3, _temp(7.0), ts=T0 + 3000))

    result = await _batch(pool, host_b, [late])

    assert [d.reason for d in result.dead_letters] == ["SPARKPLUG_NOT_BORN"]
