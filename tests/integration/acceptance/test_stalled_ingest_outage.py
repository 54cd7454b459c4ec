"""The broker lost while the writer is stalled (PostgreSQL not taking telemetry) and the read
queue is full: the session notices at once, and silence is not judged while nobody listens."""

from __future__ import annotations

import aiomqtt
import asyncpg

from protocol import Topics
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream
from tests.support.daemon import count_rows, make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
SILENCE_S = 15
SILENCE = (
    f'[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = {SILENCE_S}\n'
    'severity = "MAJOR"\n'
)
BACKLOG = 2000


async def test_the_broker_lost_under_a_stalled_writer_is_a_break_at_once(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Telemetry waits on a lock (a stalled database), the queue fills, reading pauses, and
    the broker stops. The session ends at once: the reader, blocked handing a batch to the
    full queue, used to be the only thing it watched, so the node stayed "connected" and
    "listening" until the database came back, and the inactivity monitor (which does not
    need the telemetry table) alarmed a device silent only because the broker was away."""
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, extra=SILENCE,
        # Reading paused, a broker that went away is seen by the keep-alive's writes only.
        mqtt_extra="keepalive_s = 2",
        ingest_extra="batch_max = 20\nqueue_max = 100\nread_buffer = 50",
    )  # fmt: skip
    stream = list(telemetry_stream(TOPICS, device_ids(20), BACKLOG))
    db = await asyncpg.connect(db_dsn)
    blocker = await asyncpg.connect(db_dsn)
    try:
        async with running_daemon(config) as daemon:
            session, parts = daemon.session, daemon.components
            assert session is not None
            assert parts is not None
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as device:
                quiet = b'{"ts": 1767225600000, "metrics": {"t": 1}}'
                await device.publish(TOPICS.telemetry("quiet-1"), quiet, qos=1)

            async def heard() -> bool:
                return bool(await db.fetchval("SELECT count(*) FROM telemetry"))

            await wait_until(heard, timeout=30, message="quiet-1 stored")

            # Every insert now waits for this lock: the writer stalls as on a database away.
            await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
            async with aiomqtt.Client(
                "127.0.0.1", mosquitto.port, max_inflight_messages=500
            ) as pub:
                await publish_many(pub, stream, window=500)
            await wait_until(
                lambda: session.client is not None and session.client.reading_paused,
                timeout=30, message="reading paused",
            )  # fmt: skip
            mosquitto.stop()
            await wait_until(
                lambda: not session.connected, timeout=30, message="the broker's loss seen"
            )
            assert session.hearing(SILENCE_S).listening_s == 0
            quiet_for = await db.fetchval(
                "SELECT extract(epoch FROM now() - last_seen) FROM device"
                " WHERE device_id = 'quiet-1'"
            )
            assert quiet_for < SILENCE_S, "quiet-1 was heard less than a silence before the loss"

            async def silent_for_long() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT now() - last_seen > make_interval(secs => $1) FROM device"
                        " WHERE device_id = 'quiet-1'",
                        SILENCE_S + 1,
                    )
                )

            await wait_until(silent_for_long, timeout=60, message="a silence past the rule's")
            # Nobody listened since the broker stopped: nothing to judge.
            assert await parts.inactivity.run_once() == []

            await blocker.execute("ROLLBACK")
            mosquitto.start()

            async def all_stored() -> bool:
                return await count_rows(db_dsn) == BACKLOG + 1

            await wait_until(all_stored, timeout=90, message="the backlog stored")
        assert await count_rows(db_dsn) == BACKLOG + 1
        assert await db.fetchval("SELECT count(*) FROM alarm") == 0
    finally:
        await blocker.close()
        await db.close()
