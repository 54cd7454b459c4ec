"""A Sparkplug timestamp beyond what a date can hold (an edge node sending microseconds or
nanoseconds since the epoch where Sparkplug says milliseconds, or an unset uint64) is a dead
letter ``INVALID``, as any timestamp out of range: the stream goes on (its seq is counted), the
edge node stays trusted, and nothing is taken for a bug. Through a real mosquitto to a real
daemon and PostgreSQL; the payloads are built by hand (no edge node library sends such a
timestamp on purpose)."""

from __future__ import annotations

import json

import aiomqtt
import asyncpg

from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType
from storage import sparkplug as repo
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

SPARKPLUG = """
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["Plant1"]
"""

MS = 1767225600000  # 2026-01-01T00:00:00Z in epoch milliseconds


def _payload(seq: int, *metrics: dict[str, object], ts: int = MS) -> bytes:
    message = pb.Payload(timestamp=ts, seq=seq)
    for fields in metrics:
        metric_ = message.metrics.add()
        for key, value in fields.items():
            setattr(metric_, key, value)
    return message.SerializeToString()


def _temp(value: float, *, ts: int) -> dict[str, object]:
    return {"alias": 1, "timestamp": ts, "double_value": value}


async def test_a_timestamp_in_micro_or_nanoseconds_is_invalid_and_the_stream_goes_on(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG)
    bdseq = {"name": "bdSeq", "datatype": DataType.INT64, "long_value": 1}
    temp = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}
    messages = [
        ("spBv1.0/Plant1/NBIRTH/N", _payload(0, bdseq)),
        ("spBv1.0/Plant1/DBIRTH/N/D", _payload(1, temp)),
        # Microseconds (year ~57,970), nanoseconds, an unset uint64 (2**64 - 1): no date.
        ("spBv1.0/Plant1/DDATA/N/D", _payload(2, _temp(2.0, ts=MS * 1000))),
        ("spBv1.0/Plant1/DDATA/N/D", _payload(3, _temp(3.0, ts=MS * 1000000))),
        ("spBv1.0/Plant1/DDATA/N/D", _payload(4, {"alias": 1, "double_value": 4.0}, ts=2**64 - 1)),
        ("spBv1.0/Plant1/DDATA/N/D", _payload(5, _temp(5.0, ts=MS + 5000))),
    ]
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as edge:
            for topic, body in messages:
                await edge.publish(topic, body, qos=1)

        conn = await asyncpg.connect(db_dsn)
        try:

            async def last_one_stored() -> bool:
                rows = await conn.fetch(
                    "SELECT metrics::text FROM telemetry WHERE device_id = 'Plant1/N/D'"
                )
                return {"temp": 5.0} in [json.loads(r[0]) for r in rows]

            await wait_until(last_one_stored, message="the DDATA after the bad ones stored")
            letters = await conn.fetch(
                "SELECT reason, detail FROM dead_letter WHERE topic LIKE 'spBv1.0/%' ORDER BY id"
            )
            node = await repo.get_node(conn, "Plant1", "N")
        finally:
            await conn.close()
        assert [r["reason"] for r in letters] == ["INVALID"] * 3, [dict(r) for r in letters]
        assert all("out of range" in r["detail"] for r in letters), [dict(r) for r in letters]
        assert node is not None
        assert node.trusted, node.rebirth_reason
        assert node.rebirth_wanted_at is None
        assert node.seq == 5
        assert metric(daemon, "gateway_sparkplug_untrusted_total") == 0
