"""Two nodes of a `$share` group: a device's receipt that mosquitto routes to node B while B's
broker session is down waits at the broker, in B's persistent session, and comes at B's
reconnect. B's reaper still passes (its database is fine): it used to record that it had
stored everything up to now, so node A's reaper judged the command missing (a realtime
command FAILED, TIMEOUT) while B's session held the device's answer, kept as `duplicated`
when B came back.

Real daemons, real mosquitto 2.0 (the gateway's own session: MQTT 5, clean start off, a day's
expiry, receipts on `$share/cmd/...`), real PostgreSQL; B's MQTT link behind a TCP proxy.
mosquitto round-robins a shared subscription's messages over its members, disconnected
persistent sessions included: receipts for no command are published until one is stored by
A, so that the next, the device's, goes to B.
"""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg

from gateway.domain.command import Delivery
from protocol import Topics
from tests.support.commands import new_command
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.shared_receipts import (
    device_answers,
    realtime_command_sent,
    steer_next_receipt_to_b,
    wait_answer_stored,
)
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
DEVICE = "pump-1"
ACK_WINDOW_S = 2.0
COMMANDS = f"[commands]\nack_window_s = {ACK_WINDOW_S}\nreaper_interval_s = 0.2\n"
SHARED = 'shared_group = "cmd"'


async def test_a_receipt_waiting_at_the_broker_for_another_node_is_not_judged_missing(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    link_b = TcpProxy("127.0.0.1", mosquitto.port)
    await link_b.start()
    db = await asyncpg.connect(db_dsn)
    try:
        config_a = make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-a", extra=COMMANDS,
            mqtt_extra=SHARED,
        )  # fmt: skip
        config_b = make_config(
            dsn=db_dsn, mqtt_port=link_b.port, node_id="node-b", extra=COMMANDS,
            mqtt_extra=SHARED,
        )  # fmt: skip
        async with (
            running_daemon(config_a),
            running_daemon(config_b) as node_b,
            aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="device") as device,
        ):
            await device.subscribe(TOPICS.commands(DEVICE), qos=1)

            await steer_next_receipt_to_b(db, device, TOPICS, DEVICE)
            command_id, downlink = await realtime_command_sent(db, device, DEVICE)
            # B's broker link goes away (its database stays); the device answers at once.
            await link_b.cut()

            async def b_session_down() -> bool:
                return metric(node_b, "gateway_mqtt_connected") == 0

            await wait_until(b_session_down, timeout=30, message="node-b's session down")
            await device_answers(device, TOPICS, DEVICE, command_id, downlink)

            async def windows_passed() -> bool:
                # Three ack windows, and both reapers passed since (B's database is fine).
                return bool(
                    await db.fetchval(
                        "SELECT now() - c.sent_at > make_interval(secs => $2)"
                        " AND (SELECT count(*) FROM command_hearing h"
                        "      WHERE h.passed_at > c.sent_at + make_interval(secs => $2)) = 2"
                        " FROM command c WHERE c.id = $1",
                        command_id,
                        3 * ACK_WINDOW_S,
                    )
                )

            await wait_until(windows_passed, timeout=30, message="the ack window passed")
            during = await db.fetchval("SELECT status FROM command WHERE id = $1", command_id)
            early = await db.fetch(
                "SELECT received_by, outcome FROM command_receipt WHERE command_id = $1"
                " AND raw_ack IS NULL",
                command_id,
            )
            await link_b.resume()

            await wait_answer_stored(db, command_id)
        row = await db.fetchrow("SELECT * FROM command WHERE id = $1", command_id)
        receipts = [
            tuple(r)
            for r in await db.fetch(
                "SELECT received_by, result, outcome, raw_ack FROM command_receipt"
                " WHERE command_id = $1 ORDER BY id",
                command_id,
            )
        ]
    finally:
        await db.close()
        await link_b.cut()
    # mosquitto kept the device's receipt for B's session: it did not hand it to A.
    assert early == [], f"the device's receipt was not held for node-b: {early}"
    assert during == "SENT", f"judged while node-b's session held its receipt: {during}; {receipts}"
    assert (row["status"], row["result"]) == ("ACKED", "ACKED"), (dict(row), receipts)
    assert receipts == [("node-b", "ACKED", "accepted", None)], receipts


async def test_a_node_down_past_its_session_expiry_holds_back_no_timeout(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """The bound: once B's session has been down longer than its expiry, the broker dropped
    what it kept for B, and nothing waits for B any more: A judges its commands again while
    B, cut from the broker, still passes."""
    link_b = TcpProxy("127.0.0.1", mosquitto.port)
    await link_b.start()
    db = await asyncpg.connect(db_dsn)
    try:
        config_a = make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-a", extra=COMMANDS,
            mqtt_extra=SHARED,
        )  # fmt: skip
        config_b = make_config(
            dsn=db_dsn, mqtt_port=link_b.port, node_id="node-b", extra=COMMANDS,
            mqtt_extra=f"{SHARED}\nsession_expiry_s = 3",
        )  # fmt: skip
        async with (
            running_daemon(config_a),
            running_daemon(config_b) as node_b,
            aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="device") as device,
        ):
            await device.subscribe(TOPICS.commands(DEVICE), qos=1)
            await link_b.cut()

            async def b_session_down() -> bool:
                return metric(node_b, "gateway_mqtt_connected") == 0

            await wait_until(b_session_down, timeout=30, message="node-b's session down")
            created = await new_command(
                db, device_id=DEVICE, name="open", params={"valve": 2},
                delivery=Delivery.REALTIME, node_id="test",
            )  # fmt: skip
            command_id = created.command.id
            async with asyncio.timeout(30):
                await anext(device.messages)  # the device never answers

            async def judged() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT status = 'FAILED' FROM command WHERE id = $1", command_id
                    )
                )

            await wait_until(judged, timeout=30, message="the command timed out by node-a")
            b_passing = await db.fetchval(
                "SELECT passed_at > now() - interval '5 seconds' FROM command_hearing"
                " WHERE node_id = 'node-b'"
            )
            assert metric(node_b, "gateway_mqtt_connected") == 0
            await link_b.resume()
        row = await db.fetchrow("SELECT * FROM command WHERE id = $1", command_id)
    finally:
        await db.close()
        await link_b.cut()
    assert b_passing, "node-b's reaper stopped passing: the bound was not what was tested"
    assert (row["status"], row["result"]) == ("FAILED", "TIMEOUT"), dict(row)
