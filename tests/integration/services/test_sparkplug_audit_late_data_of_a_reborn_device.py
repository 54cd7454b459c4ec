"""Data a device sent under one `DBIRTH`, committed after its next `DBIRTH` by a slower node of
a `$share` group, is not read with the newer birth's aliases.

The edge node births a device (seq 1, alias 1 `temp`), sends its `DDATA` (seq 2, held by host
B), the device dies (seq 3) and is born again with alias 1 another metric (seq 4, `pressure`);
host A commits 3 and 4 first. The late `DDATA` found the device born and was read with the
birth in force: a `temp` stored, and judged, as `pressure`. The device's last life taken while
a seq was missing (migration 0062) says it began after that data: a dead letter
`SPARKPLUG_OLD_SESSION`, its bytes kept, moving nothing. Data of the birth in force, late too,
is read.

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


async def _samples(pool: asyncpg.Pool) -> list[dict[str, object]]:
    rows = await pool.fetch(
        "SELECT metrics::text FROM telemetry WHERE device_id = 'G/N/D' ORDER BY ts"
    )
    return [json.loads(row[0]) for row in rows]


async def test_late_data_of_the_birth_before_is_not_read_with_the_new_births_aliases(
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
    old = ("DDATA", DEVICE, _payload(2, _temp(7.0), ts=T0 + 2000))
    new = ("DDATA", DEVICE, _payload(6, _temp(9.0), ts=T0 + 6000))
    await _batch(
        pool,
        host_a,
        [
            ("DDEATH", DEVICE, _payload(3, ts=T0 + 3000)),
            ("DBIRTH", DEVICE, _payload(4, _metric("pressure"), ts=T0 + 4000)),
            ("DDATA", DEVICE, _payload(7, _temp(10.0), ts=T0 + 7000)),
        ],
    )

    result = await _batch(pool, host_b, [old, new])

    assert {"pressure": 7.0} not in await _samples(pool), "read with the newer birth's aliases"
    assert [(d.reason, d.payload) for d in result.dead_letters] == [
        ("SPARKPLUG_OLD_SESSION", old[2])
    ]
    # The birth in force's own late data is read.
    assert {"pressure": 9.0} in await _samples(pool)
    assert await _presence(pool, "G/N/D") == "online"
    state = await _state(pool)
    assert state.devices == ["D"]
    assert state.trusted
