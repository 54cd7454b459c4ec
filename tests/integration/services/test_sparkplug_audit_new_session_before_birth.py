"""Data of an edge node's new session committed before that session's `NBIRTH` (another node of
a `$share` group holds the births) is not read with the old session's aliases.

The edge node's old session gives alias 1 to `temp`; it starts a new session (`NBIRTH` seq 0,
`DBIRTH` seq 1 giving alias 1 to `pressure`) and sends `DDATA` seq 2. Host A holds the births;
host B commits the `DDATA` first. Its seq either goes back from the old session's (the stream
started again), or, near the old session's wrap, skips forward over seq 0 within the reorder
window while the node waits for the rebirth it was asked for: it was read with the old aliases,
stored as `temp`. An untrusted node's data that uses aliases while seq 0 of its stream is
missing (an `NBIRTH` may be there) is a dead letter `SPARKPLUG_SESSION_UNKNOWN`, its bytes kept;
replayed once the birth is stored it is read as `pressure`. A seq 0 that comes as data (the old
session's own wrap, reordered) ends the doubt; a trusted node's wrap reordered is read as
before.

Real PostgreSQL, the ingest store and the dead-letter replay, the two nodes' hosts side by side
(as test_sparkplug_audit_old_session_data.py)."""

from __future__ import annotations

import json

import asyncpg

from gateway.ingest import live_path
from gateway.ingest.replay import pending_ids, replay
from gateway.sparkplug.host import SparkplugHost
from gateway.support.metrics import Metrics
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
from tests.support.daemon import make_config

T0 = 1767225600000
EXTRA = '[sparkplug]\nenabled = true\nhost_id = "gw-host"\ngroups = ["G"]\n'


def _births(bdseq: int, metric: str, ts: int) -> list[tuple[str, str, bytes]]:
    birth = {"name": metric, "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}
    return [
        ("NBIRTH", NODE, _payload(0, _bdseq(bdseq), ts=ts)),
        ("DBIRTH", DEVICE, _payload(1, birth, ts=ts)),
    ]


def _data(seq: int, value: float, ts: int) -> tuple[str, str, bytes]:
    return ("DDATA", DEVICE, _payload(seq, _temp(value), ts=ts))


async def _samples(pool: asyncpg.Pool) -> list[dict[str, object]]:
    rows = await pool.fetch(
        "SELECT metrics::text FROM telemetry WHERE device_id = 'G/N/D' ORDER BY ts"
    )
    return [json.loads(row[0]) for row in rows]


async def _old_session(pool: asyncpg.Pool, host: SparkplugHost, last: int) -> None:
    """The old session's births and its data up to seq ``last``, in order."""
    await _batch(pool, host, _births(0, "temp", T0))
    data = [_data(seq, seq + 0.5, T0 + seq) for seq in range(2, last + 1)]
    for start in range(0, len(data), 100):
        await _batch(pool, host, data[start : start + 100])


async def _replayed(pool: asyncpg.Pool, db_dsn: str) -> list[tuple[str, bool]]:
    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, extra=EXTRA), Metrics())
    outcomes = await replay(pool, path, await pending_ids(pool, "SPARKPLUG_SESSION_UNKNOWN"))
    return [(o.outcome, o.succeeded) for o in outcomes]


async def test_new_session_data_whose_seq_goes_back_waits_for_its_birth(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _old_session(pool, host_a, 5)
    new = [_data(2, 8.0, T0 + 11_000), _data(3, 9.0, T0 + 12_000)]

    result = await _batch(pool, host_b, new)

    assert all(m not in ({"temp": 8.0}, {"temp": 9.0}) for m in await _samples(pool)), (
        "new-session data read with the old session's aliases"
    )
    assert [(d.reason, d.payload) for d in result.dead_letters] == [
        ("SPARKPLUG_SESSION_UNKNOWN", new[0][2]),
        ("SPARKPLUG_SESSION_UNKNOWN", new[1][2]),
    ]
    # Its births are committed: the letters replayed are read with them.
    await _batch(pool, host_a, _births(1, "pressure", T0 + 10_000))
    assert await _replayed(pool, db_dsn) == [("stored", True)] * 2
    samples = await _samples(pool)
    assert {"pressure": 8.0} in samples
    assert {"pressure": 9.0} in samples


async def _asked_for_a_rebirth(pool: asyncpg.Pool, host: SparkplugHost) -> None:
    """The old session to seq 253, then an alias no birth defined (seq 254): untrusted, a
    rebirth asked for."""
    await _old_session(pool, host, 253)
    unknown = ("DDATA", DEVICE, _payload(254, _temp(0.5, alias=9), ts=T0 + 254))
    await _batch(pool, host, [unknown])
    state = await _state(pool)
    assert not state.trusted
    assert state.rebirth_reason is not None


async def test_rebirth_data_skipping_over_seq_0_waits_for_its_birth(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """The rebirth asked for moves alias 1; its data (seq 2) is committed before its births:
    from seq 254, seq 2 skips over 0 within the reorder window."""
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _asked_for_a_rebirth(pool, host_a)
    new = _data(2, 8.0, T0 + 11_000)

    result = await _batch(pool, host_b, [new])

    assert {"temp": 8.0} not in await _samples(pool), "read with the old session's aliases"
    assert [(d.reason, d.payload) for d in result.dead_letters] == [
        ("SPARKPLUG_SESSION_UNKNOWN", new[2])
    ]
    await _batch(pool, host_a, _births(0, "pressure", T0 + 10_000))
    state = await _state(pool)
    assert (state.seq, state.trusted) == (1, True)
    assert await _replayed(pool, db_dsn) == [("stored", True)]
    assert {"pressure": 8.0} in await _samples(pool)


async def test_a_trusted_nodes_wrap_reordered_is_read(pool: asyncpg.Pool) -> None:
    """Seq 1 of a trusted node's wrap committed before 255 and 0 (host B's): its own stream,
    reordered, as every wrap may be in a `$share` group; read, the node trusted."""
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _old_session(pool, host_a, 254)

    result = await _batch(pool, host_a, [_data(1, 1001.0, T0 + 1001)])
    assert result.dead_letters == ()
    result = await _batch(pool, host_b, [_data(255, 255.0, T0 + 255), _data(0, 1000.0, T0 + 1000)])
    assert result.dead_letters == ()
    samples = await _samples(pool)
    assert {"temp": 1001.0} in samples
    assert {"temp": 1000.0} in samples
    state = await _state(pool)
    assert state.trusted
    assert state.rebirth_reason is None


async def test_seq_0_taken_as_data_ends_the_doubt(pool: asyncpg.Pool) -> None:
    """Untrusted (a rebirth asked for), seq 1 committed before 255 and 0: held (seq 0 may be
    the NBIRTH); 255 and 0 come as data, the old session's own wrap, and seq 2 is read."""
    host_a = SparkplugHost(reorder_window_s=5)
    host_b = SparkplugHost(reorder_window_s=5)
    await _asked_for_a_rebirth(pool, host_a)

    result = await _batch(pool, host_a, [_data(1, 1001.0, T0 + 1001)])
    assert [d.reason for d in result.dead_letters] == ["SPARKPLUG_SESSION_UNKNOWN"]
    result = await _batch(pool, host_b, [_data(255, 255.0, T0 + 255), _data(0, 1000.0, T0 + 1000)])
    assert result.dead_letters == ()
    result = await _batch(pool, host_a, [_data(2, 1002.0, T0 + 1002)])
    assert result.dead_letters == ()
    samples = await _samples(pool)
    assert {"temp": 1000.0} in samples
    assert {"temp": 1002.0} in samples
