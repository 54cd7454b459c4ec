"""Two daemons on one database, each subscribed to every device (no shared group): each
message reaches both, is stored once, wherever its day lives (today's partition, the default
one); and each daemon's maintenance loop runs from its start."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import aiomqtt
import asyncpg

from gateway.maintenance.runner import utc_day
from protocol import Telemetry, Topics, encode_telemetry, telemetry_event_id
from sim.publisher import publish_many
from tests.support.daemon import count_rows, make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
RETENTION = "telemetry_days = 0\npartitions_ahead_days = 20"


async def test_two_daemons_store_each_event_once_in_every_kind_of_partition(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    moments = [now + timedelta(seconds=n) for n in range(60)]  # today, or tomorrow: made ahead
    moments += [datetime(1970, 1, 2, tzinfo=UTC), datetime(2999, 1, 1, tzinfo=UTC)]
    messages = [
        Telemetry(ts=int(ts.timestamp() * 1000), seq=n, metrics={"temp": 20.0 + n})
        for n, ts in enumerate(moments)
    ]
    stream = [
        (TOPICS.telemetry(f"dev-{n % 3}"), encode_telemetry(m)) for n, m in enumerate(messages)
    ]
    ids = {telemetry_event_id(f"dev-{n % 3}", m) for n, m in enumerate(messages)}
    configs = [
        make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}", retention=RETENTION)
        for n in (1, 2)
    ]
    async with running_daemon(configs[0]) as one, running_daemon(configs[1]) as two:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, stream, window=50)
            await publish_many(pub, stream, window=50)  # and a redelivery of every one
        for daemon in (one, two):
            await wait_until(
                lambda d=daemon: metric(d, "gateway_telemetry_received_total") >= 2 * len(stream),
                timeout=60,
                message="every copy received by both",
            )
        # Each daemon's maintenance ran at its start: partitions 20 days ahead.
        ahead = f"telemetry_p{utc_day(now) + timedelta(days=20):%Y%m%d}"
        conn = await asyncpg.connect(db_dsn)
        try:
            await wait_until(
                lambda: conn.fetchval("SELECT to_regclass($1) IS NOT NULL", ahead),
                timeout=30,
                message="the maintenance loop made the partitions ahead",
            )
            stored = await conn.fetch(
                "SELECT event_id, tableoid::regclass::text AS part FROM telemetry"
            )
        finally:
            await conn.close()
        stored_total = sum(metric(d, "gateway_telemetry_stored_total") for d in (one, two))
    assert len(stored) == len(ids) == await count_rows(db_dsn)
    assert {r["event_id"] for r in stored} == ids
    assert stored_total == len(ids)
    assert sum(r["part"] == "telemetry_default" for r in stored) == 2
