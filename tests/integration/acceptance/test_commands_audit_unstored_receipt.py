"""A device's receipt the node received in time, still waiting in its ingest queue when the ack
window ends: the node has not heard it yet, so it must not judge the receipt missing.

The writer lags when PostgreSQL is slow to take telemetry (a lock on its table, an I/O stall,
the backlog a broker resends after an outage); the reaper's own passes, on the command table,
still get through. Here the telemetry table is locked by another session (as a maintenance job
would), a device's sample holds the node's one ingest transaction, and the device's receipt
queues behind it. Real daemon, real mosquitto, real PostgreSQL, the simulator's responder.
"""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg

from gateway.domain.command import Delivery
from protocol import Topics
from sim.responder import Responder, Script
from tests.support.commands import new_command
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
DEVICE = "pump-1"
ACK_WINDOW_S = 2.0
COMMANDS = f"[commands]\nack_window_s = {ACK_WINDOW_S}\nreaper_interval_s = 0.2\n"


async def test_a_receipt_waiting_in_the_ingest_queue_is_not_judged_missing(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    responder = Responder(host="127.0.0.1", port=mosquitto.port, topics=TOPICS, script=Script())
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop))
    db = await asyncpg.connect(db_dsn)
    blocker = await asyncpg.connect(db_dsn)
    try:
        await responder.wait_subscribed()
        config = make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-a", extra=COMMANDS,
            ingest_extra="transactions_in_flight = 1",
        )  # fmt: skip
        async with running_daemon(config) as daemon:
            writer = daemon.writer
            assert writer is not None
            # Telemetry inserts wait for this lock: the node's ingest transaction stays open.
            await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as device:
                await device.publish(
                    TOPICS.telemetry(DEVICE),
                    b'{"ts": 1767225600000, "metrics": {"flow": 1.5}}',
                    qos=1,
                )
            await wait_until(
                lambda: writer.in_db_call_since is not None, timeout=30,
                message="the sample's transaction waiting for the lock",
            )  # fmt: skip
            created = await new_command(
                db, device_id=DEVICE, name="open", params={"valve": 2},
                delivery=Delivery.REALTIME, idempotency_key=None, actor="test",
                node_id="test", expire_after_s=3600,
            )  # fmt: skip
            command_id = created.command.id
            # The device answered at once; the node received the answer, queued behind the
            # sample (two messages held unstored).
            await wait_until(
                lambda: responder.answered == 1
                and metric(daemon, "gateway_ingest_inflight") == 2,
                timeout=30, message="the receipt received and queued",
            )  # fmt: skip

            async def windows_passed() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT now() - sent_at > make_interval(secs => $2)"
                        " FROM command WHERE id = $1",
                        command_id,
                        3 * ACK_WINDOW_S,
                    )
                )

            # Three ack windows (the reaper passes every 0.2 s): long enough to judge it.
            await wait_until(windows_passed, timeout=30, message="the ack window passed")
            during = await db.fetchval("SELECT status FROM command WHERE id = $1", command_id)
            await blocker.execute("ROLLBACK")

            async def receipt_stored() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT count(*) FROM command_receipt WHERE command_id = $1"
                        " AND received_by = 'node-a' AND raw_ack IS DISTINCT FROM"
                        " 'no receipt within 2s (reported by node-a)'",
                        command_id,
                    )
                )

            await wait_until(receipt_stored, timeout=30, message="the device's receipt stored")
        row = await db.fetchrow("SELECT status, result FROM command WHERE id = $1", command_id)
        receipts = [
            tuple(r)
            for r in await db.fetch(
                "SELECT result, outcome, raw_ack FROM command_receipt WHERE command_id = $1"
                " ORDER BY id",
                command_id,
            )
        ]
    finally:
        stop.set()
        await answering
        await blocker.close()
        await db.close()
    assert during == "SENT", f"judged while its receipt waited unstored: {during}; {receipts}"
    assert (row["status"], row["result"]) == ("ACKED", "ACKED"), receipts
    assert [r[1] for r in receipts] == ["accepted"], receipts
