"""The broker restarts while a batch is in its transaction: the batch commits after the
reconnect. Its PUBACKs belong to the old connection and are not sent on the new one (there
its packet ids may be other messages'); what the broker kept is delivered again and found
stored; what it lost (no persistence: the session is new) was stored by the old batch. Both
protocol versions."""

from __future__ import annotations

from pathlib import Path

import aiomqtt
import asyncpg
import pytest

from protocol import Topics
from tests.support.daemon import count_rows, make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
FIRST = 5


async def _publish(port: int, first: int, count: int) -> None:
    async with aiomqtt.Client("127.0.0.1", port) as device:
        for n in range(first, first + count):
            payload = f'{{"ts": {1_767_225_600_000 + n}, "metrics": {{"n": {n}}}}}'
            await device.publish(TOPICS.telemetry(f"dev-{n}"), payload.encode(), qos=1)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
@pytest.mark.parametrize("persistence", [True, False], ids=["kept", "lost"])
async def test_a_batch_committed_after_the_broker_restarted_is_acknowledged_nowhere(
    db_dsn: str, tmp_path: Path, protocol: str, persistence: bool
) -> None:
    broker = Mosquitto(tmp_path / "mosquitto", persistence=persistence)
    broker.start()
    blocker = await asyncpg.connect(db_dsn)
    try:
        config = make_config(dsn=db_dsn, mqtt_port=broker.port, protocol=protocol)
        async with running_daemon(config) as daemon:
            session, writer = daemon.session, daemon.writer
            assert session is not None
            assert writer is not None
            # Every insert now waits for this lock: the batch stays in its transaction.
            await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
            await _publish(broker.port, 0, FIRST)
            # Every message received, and a batch in its transaction. Not necessarily one
            # batch: under load the five may arrive further apart than the linger, and split
            # into batches (the flights in their transactions, the rest queued behind them);
            # every one of them is the old connection's, and commits after the reconnect.
            await wait_until(
                lambda: metric(daemon, "gateway_ingest_inflight") == FIRST
                and writer.in_db_call_since is not None,
                timeout=30, message="the batch in its transaction",
            )  # fmt: skip
            broker.restart()
            await wait_until(
                lambda: session.connections >= 2 and session.subscribed,
                timeout=30, message="subscribed again",
            )  # fmt: skip
            await blocker.execute("ROLLBACK")  # the old batch commits now

            async def stored(count: int) -> bool:
                return await count_rows(db_dsn) == count

            await wait_until(lambda: stored(FIRST), timeout=30, message="the batch stored")
            # The subscriptions hold on the new session (made again when the broker lost it).
            await _publish(broker.port, FIRST, FIRST)
            await wait_until(lambda: stored(2 * FIRST), timeout=30, message="all stored")
            await wait_until(
                lambda: writer.queue.qsize() == 0
                and metric(daemon, "gateway_ingest_inflight") == 0,
                timeout=30, message="everything acknowledged",
            )  # fmt: skip
            skipped = metric(daemon, "gateway_acks_skipped_total")
            duplicates = metric(daemon, "gateway_telemetry_duplicates_total")
    finally:
        await blocker.close()
        broker.stop()
    assert await count_rows(db_dsn) == 2 * FIRST
    # The old batch's PUBACKs were for the old connection: none was sent on the new one.
    assert skipped == FIRST
    # A broker that kept the session delivered the old batch again (found stored); one that
    # lost it had nothing to deliver again.
    assert duplicates == (FIRST if persistence else 0)
