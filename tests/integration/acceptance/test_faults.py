"""No loss, no duplicates: the database going away, the broker restarting, shared groups."""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg

from gateway.runtime.daemon import Daemon
from protocol import Topics
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream
from tests.support.daemon import count_rows, make_config, metric, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
SLOW_INGEST = "batch_max = 20\nlinger_ms = 0"


def _acked(daemon: Daemon) -> float:
    return metric(daemon, "gateway_ingest_handler_seconds_count")


async def test_database_unreachable_at_start_and_during_a_run(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    await proxy.cut()  # unreachable before the daemon even starts
    config = make_config(
        dsn=through(db_dsn, proxy), mqtt_port=mosquitto.port, ingest_extra=SLOW_INGEST
    )
    daemon = Daemon(config)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        await wait_until(lambda: metric(daemon, "gateway_db_retries_total") >= 3, timeout=30)
        assert not daemon.ready.is_set()
        await proxy.resume()
        async with asyncio.timeout(30):
            await daemon.ready.wait()

        stream = list(telemetry_stream(TOPICS, device_ids(20), 3000))
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=500) as pub:
            await publish_many(pub, stream[:1500], window=500)
            await wait_until(lambda: _acked(daemon) >= 300, timeout=30)
            await proxy.cut()  # mid-stream
            retries = metric(daemon, "gateway_db_retries_total")
            await wait_until(
                lambda: metric(daemon, "gateway_db_retries_total") >= retries + 2, timeout=30
            )
            acked_while_down = _acked(daemon)
            await publish_many(pub, stream[1500:], window=500)
            await wait_until(
                lambda: metric(daemon, "gateway_db_retries_total") >= retries + 5, timeout=30
            )
            # Nothing is acknowledged while nothing can be stored.
            assert _acked(daemon) == acked_while_down
            assert acked_while_down < 3000
            await proxy.resume()
            await wait_until(lambda: _acked(daemon) >= 3000, timeout=60)
        assert await count_rows(db_dsn) == 3000
        # A batch whose COMMIT reached the server just before the cut is retried and then
        # found stored: counted as duplicates, never stored twice.
        assert (
            metric(daemon, "gateway_telemetry_stored_total")
            + metric(daemon, "gateway_telemetry_duplicates_total")
            == 3000
        )
    finally:
        stop.set()
        async with asyncio.timeout(60):
            await task
        await proxy.stop()


async def test_broker_restart_mid_stream_loses_nothing(db_dsn: str, mosquitto: Mosquitto) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, ingest_extra=SLOW_INGEST)
    stream = list(telemetry_stream(TOPICS, device_ids(50), 5000))
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=500) as pub:
            await publish_many(pub, stream[:3000], window=500)
        await wait_until(lambda: _acked(daemon) >= 300, timeout=30)
        stored_before = await count_rows(db_dsn)
        mosquitto.restart()  # queued and unacknowledged messages survive in its persistence
        assert stored_before < 3000, "the restart must happen while the backlog drains"
        await wait_until(
            lambda: daemon.session is not None and daemon.session.connections >= 2,
            timeout=30,
            message="the daemon reconnected",
        )
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=500) as pub:
            await publish_many(pub, stream[3000:], window=500)
        await wait_until(_count_is(db_dsn, 5000), timeout=60, message="all 5000 stored")
    assert await count_rows(db_dsn) == 5000


def _count_is(dsn: str, expected: int):  # type: ignore[no-untyped-def]  # a predicate for wait_until
    async def check() -> bool:
        return await count_rows(dsn) == expected

    return check


async def test_two_nodes_in_a_shared_group_store_each_message_once(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    configs = [
        make_config(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            node_id=f"node-{n}",
            mqtt_extra='shared_group = "ingest"',
        )
        for n in (1, 2)
    ]
    stream = list(telemetry_stream(TOPICS, device_ids(40), 4000))
    async with running_daemon(configs[0]) as one, running_daemon(configs[1]) as two:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=500) as pub:
            await publish_many(pub, stream, window=500)
        await wait_until(_count_is(db_dsn, 4000), timeout=60)
        await wait_until(lambda: _acked(one) + _acked(two) >= 4000, timeout=30)
        received = [metric(d, "gateway_telemetry_received_total") for d in (one, two)]
    assert all(r > 0 for r in received), received  # both did part of the work
    assert sum(received) == 4000  # and no message went to both
    assert await count_rows(db_dsn) == 4000


async def test_a_stalled_database_bounds_memory_instead_of_buffering_the_backlog(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        ingest_extra="batch_max = 20\nqueue_max = 100\nread_buffer = 50",
    )  # fmt: skip
    stream = list(telemetry_stream(TOPICS, device_ids(20), 5000))
    blocker = await asyncpg.connect(db_dsn)
    try:
        async with running_daemon(config) as daemon:
            # Every insert now waits for this lock: the writer stalls like on a stuck disk.
            await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
            async with aiomqtt.Client(
                "127.0.0.1", mosquitto.port, max_inflight_messages=500
            ) as pub:
                await publish_many(pub, stream, window=500)
            session = daemon.session
            assert session is not None
            await wait_until(
                lambda: session.client is not None and session.client.reading_paused,
                timeout=30, message="reading paused",
            )  # fmt: skip
            client, writer = session.client, daemon.writer
            assert client is not None
            assert writer is not None
            assert writer.queue.qsize() <= 100
            assert client.buffered <= 51
            # The queue, a batch in each transaction in flight, and the message in hand.
            assert writer.in_flight == 2
            assert metric(daemon, "gateway_ingest_inflight") <= 100 + 2 * 20 + 1
            assert _acked(daemon) == 0
            await blocker.execute("ROLLBACK")
            await wait_until(_count_is(db_dsn, 5000), timeout=60, message="all 5000 stored")
            assert client.pauses >= 2  # it paused and resumed as the writer caught up
    finally:
        await blocker.close()
    assert await count_rows(db_dsn) == 5000
