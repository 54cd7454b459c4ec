"""Two nodes of a `$share` group: a device's receipt, received in time by node B but held
unstored there (B's database away for a moment: its writer retries), must not be judged missing
by node A's reaper. A used to wait only for what it held unstored itself: it timed the command
out (a realtime command FAILED) while B held the device's answer, kept as `duplicated` when B
stored it.

Real daemons, real mosquitto, real PostgreSQL; B's database behind a TCP proxy. mosquitto
round-robins a shared subscription's messages over its members: receipts for no command are
published until one is stored by A, so that the next, the device's, goes to B.
"""

from __future__ import annotations

import time

import aiomqtt
import asyncpg

from protocol import Topics
from tests.support.daemon import make_config, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.shared_receipts import (
    device_answers,
    realtime_command_sent,
    steer_next_receipt_to_b,
    wait_answer_stored,
)
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
DEVICE = "pump-1"
ACK_WINDOW_S = 2.0
COMMANDS = f"[commands]\nack_window_s = {ACK_WINDOW_S}\nreaper_interval_s = 0.2\n"
SHARED = 'shared_group = "cmd"'


async def test_a_receipt_another_node_holds_unstored_is_not_judged_missing(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    database = proxy_for(db_dsn)
    await database.start()
    db = await asyncpg.connect(db_dsn)
    try:
        config_a = make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-a", extra=COMMANDS,
            mqtt_extra=SHARED,
        )  # fmt: skip
        config_b = make_config(
            dsn=through(db_dsn, database), mqtt_port=mosquitto.port, node_id="node-b",
            extra=COMMANDS, mqtt_extra=SHARED,
        )  # fmt: skip
        async with (
            running_daemon(config_a),
            running_daemon(config_b),
            aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="device") as device,
        ):
            await device.subscribe(TOPICS.commands(DEVICE), qos=1)

            await steer_next_receipt_to_b(db, device, TOPICS, DEVICE)
            command_id, downlink = await realtime_command_sent(db, device, DEVICE)
            # B's database goes away; the device answers at once, and B receives the answer.
            await database.cut()
            answered_at = time.monotonic()
            await device_answers(device, TOPICS, DEVICE, command_id, downlink)

            async def windows_passed() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT now() - sent_at > make_interval(secs => $2)"
                        " FROM command WHERE id = $1",
                        command_id,
                        3 * ACK_WINDOW_S,
                    )
                )

            # Three ack windows of node A's passes (every 0.2 s): long enough to judge it.
            await wait_until(windows_passed, timeout=30, message="the ack window passed")
            during = await db.fetchval("SELECT status FROM command WHERE id = $1", command_id)
            assert time.monotonic() - answered_at < 30  # B's outage far within a minute
            await database.resume()

            await wait_answer_stored(db, command_id)
        row = await db.fetchrow("SELECT * FROM command WHERE id = $1", command_id)
        trail = [
            tuple(r)
            for r in await db.fetch(
                "SELECT actor, action, from_status, to_status, node_id FROM command_audit"
                " WHERE command_id = $1 ORDER BY id",
                command_id,
            )
        ]
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
        await database.stop()
    assert during == "SENT", f"judged while node-b held its receipt unstored: {during}; {receipts}"
    assert (row["status"], row["result"]) == ("ACKED", "ACKED"), (dict(row), receipts, trail)
    assert receipts == [("node-b", "ACKED", "accepted", None)], receipts
