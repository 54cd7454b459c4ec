"""The broker lost while the writer is stalled (PostgreSQL not taking telemetry) and the read
queue is full: the session notices at once, and silence is not judged while nobody listens."""

from __future__ import annotations

import aiomqtt
import asyncpg
import pytest

from protocol import Topics
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream
from tests.support.daemon import count_rows, make_config, metric, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
SILENCE_S = 15
SILENCE = (
    f'[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = {SILENCE_S}\n'
    'severity = "MAJOR"\n'
)
BACKLOG = 2000
FAST_SILENCE_S = 2
FAST_SILENCE = (
    f'[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = {FAST_SILENCE_S}\n'
    'severity = "MAJOR"\n'
)


async def _report(mosquitto: Mosquitto, n: int) -> None:
    """The talker's n-th report."""
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as device:
        payload = f'{{"ts": {1_767_225_600_000 + n}, "metrics": {{"t": {n}}}}}'
        await device.publish(TOPICS.telemetry("talker"), payload.encode(), qos=1)


async def _stored(db_dsn: str, count: int) -> bool:
    return await count_rows(db_dsn) == count


async def _past_the_silence(db: asyncpg.Connection) -> bool:
    """The talker's last_seen is two silences old."""
    return bool(
        await db.fetchval(
            "SELECT now() - last_seen > make_interval(secs => $1) FROM device"
            " WHERE device_id = 'talker'",
            2 * FAST_SILENCE_S,
        )
    )


async def _first_report_stored(mosquitto: Mosquitto, db_dsn: str) -> None:
    await _report(mosquitto, 0)
    await wait_until(lambda: _stored(db_dsn, 1), timeout=30, message="the first report stored")


async def _alarmed_then_stored(
    db: asyncpg.Connection, blocker: asyncpg.Connection, db_dsn: str
) -> int:
    """The talker's alarms while the node holds its second report; then the lock on telemetry
    released and that report stored."""
    alarmed: int = await db.fetchval("SELECT count(*) FROM alarm WHERE device_id = 'talker'")
    await blocker.execute("ROLLBACK")
    await wait_until(lambda: _stored(db_dsn, 2), timeout=30, message="the second report stored")
    return alarmed


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_the_broker_lost_under_a_stalled_writer_is_a_break_at_once(
    db_dsn: str, mosquitto: Mosquitto, protocol: str
) -> None:
    """Telemetry waits on a lock (a stalled database), the queue fills, reading pauses, and
    the broker stops. The session ends at once: the reader, blocked handing a batch to the
    full queue, used to be the only thing it watched, so the node stayed "connected" and
    "listening" until the database came back, and the inactivity monitor (which does not
    need the telemetry table) alarmed a device silent only because the broker was away."""
    # Bounds below mosquitto's window of unacknowledged deliveries (100, on MQTT 3.1.1 the
    # only one): the queue fills and the reader blocks on it.
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, extra=SILENCE, protocol=protocol,
        # Reading paused, a broker that went away is seen by the keep-alive's writes only.
        mqtt_extra="keepalive_s = 2",
        ingest_extra="batch_max = 5\nqueue_max = 10\nread_buffer = 5",
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


async def test_a_device_whose_message_waits_in_a_stalled_writer_is_not_silent(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=FAST_SILENCE)
    db = await asyncpg.connect(db_dsn)
    blocker = await asyncpg.connect(db_dsn)
    try:
        async with running_daemon(config) as daemon:
            writer, parts = daemon.writer, daemon.components
            assert writer is not None
            assert parts is not None

            await _first_report_stored(mosquitto, db_dsn)
            # Telemetry waits on this lock; the rest of the database answers.
            await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
            await _report(mosquitto, 1)
            await wait_until(
                lambda: writer.in_db_call_since is not None, timeout=30, message="in flight"
            )

            await wait_until(
                lambda: _past_the_silence(db), timeout=30, message="last_seen a silence ago"
            )
            # The talker spoke a moment after its last stored report: the node holds it. (A
            # pass now, at least: the monitor's own loop may have run one already.)
            await parts.inactivity.run_once()
            alarmed = await _alarmed_then_stored(db, blocker, db_dsn)
    finally:
        await blocker.close()
        await db.close()
    assert alarmed == 0


async def test_a_device_whose_message_waits_out_a_database_outage_is_not_silent_after_it(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """PostgreSQL away (a proxy cut), the broker fine: the node receives the talker's report
    and holds it while the writer retries. When the database is back, the monitor's first
    pass comes before the backlog is stored (here: pinned by a lock on telemetry, taken before
    the proxy resumes): the talker's last_seen is a silence old, but the node holds its
    report, so it is not silent. It used to be alarmed at once: a false alarm per device at
    the end of every outage longer than a silence."""
    proxy = proxy_for(db_dsn)
    await proxy.start()
    config = make_config(dsn=through(db_dsn, proxy), mqtt_port=mosquitto.port, extra=FAST_SILENCE)
    db = await asyncpg.connect(db_dsn)
    blocker = await asyncpg.connect(db_dsn)
    try:
        async with running_daemon(config) as daemon:
            parts = daemon.components
            assert parts is not None

            await _first_report_stored(mosquitto, db_dsn)
            await proxy.cut()
            await _report(mosquitto, 1)
            await wait_until(
                lambda: metric(daemon, "gateway_ingest_inflight") == 1,
                timeout=30, message="the second report held by the node",
            )  # fmt: skip

            await wait_until(
                lambda: _past_the_silence(db), timeout=30, message="last_seen a silence ago"
            )
            # The backlog cannot be stored before the monitor has looked, whatever the order
            # of the node's retries once PostgreSQL answers again.
            await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
            await proxy.resume()

            async def a_pass_done() -> bool:
                try:
                    await parts.inactivity.run_once()
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                    return False  # the pool still finding its way back
                return True

            await wait_until(a_pass_done, timeout=30, message="a pass with the database back")
            assert metric(daemon, "gateway_ingest_inflight") == 1, "the report is still held"
            alarmed = await _alarmed_then_stored(db, blocker, db_dsn)
    finally:
        await blocker.close()
        await db.close()
        await proxy.stop()
    assert alarmed == 0
