"""A device that answers ``SENT`` ("received, working on it") and finishes after the ack window.

The ack window is for a downlink with no receipt at all ("A SENT command with no receipt from
the device within this many seconds is treated like a TIMEOUT receipt", config.example.toml;
docs/commands.md, Reaper): a device that said it has the command and is working on it did
answer. Its final ACKED, later than the window, is the command's outcome; a day without one
(``sent_timeout_s``) is the limit. Real daemon, real mosquitto, a real MQTT device.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiomqtt
import asyncpg
import msgspec
import pytest

from gateway.domain.command import Delivery
from protocol import Topics
from tests.support.commands import new_command
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
DEVICE = "kiln-1"
ACK_WINDOW_S = 1.0
COMMANDS = f"[commands]\nack_window_s = {ACK_WINDOW_S}\nreaper_interval_s = 0.2\n"


async def _slow_device(port: int, subscribed: asyncio.Event, finish: asyncio.Event) -> None:
    """Answers SENT at once, then ACKED once ``finish`` is set (a long firing cycle)."""
    async with aiomqtt.Client("127.0.0.1", port, identifier="kiln-1-device") as client:
        await client.subscribe(TOPICS.commands(DEVICE), qos=1)
        subscribed.set()
        async for message in client.messages:
            body = msgspec.json.decode(bytes(message.payload))  # type: ignore[arg-type]
            claim = {k: body[k] for k in ("commandId", "claimGeneration", "nodeId")}
            working = msgspec.json.encode({**claim, "result": "SENT"})
            await client.publish(TOPICS.acks(DEVICE), working, qos=1)
            await finish.wait()
            done = msgspec.json.encode({**claim, "result": "ACKED", "resultCode": 0})
            await client.publish(TOPICS.acks(DEVICE), done, qos=1)


@pytest.mark.parametrize("delivery", [Delivery.REALTIME, Delivery.DEFERRABLE])
async def test_a_device_working_on_a_command_past_the_ack_window_finishes_it(
    db_dsn: str, mosquitto: Mosquitto, delivery: Delivery
) -> None:
    subscribed, finish = asyncio.Event(), asyncio.Event()
    device = asyncio.create_task(_slow_device(mosquitto.port, subscribed, finish))
    db = await asyncpg.connect(db_dsn)
    try:
        await asyncio.wait_for(subscribed.wait(), 30)
        config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=COMMANDS)
        async with running_daemon(config):
            created = await new_command(
                db, device_id=DEVICE, name="fire", params={"program": 3}, delivery=delivery,
                idempotency_key=None, actor="test", node_id="test", expire_after_s=3600,
            )  # fmt: skip
            command_id = created.command.id

            async def working_past_the_window() -> bool:
                # The device's SENT receipt stored, and three ack windows gone since the send.
                return bool(
                    await db.fetchval(
                        "SELECT EXISTS (SELECT 1 FROM command_receipt"
                        "  WHERE command_id = $1 AND result = 'SENT' AND outcome = 'accepted')"
                        " AND (SELECT now() - sent_at > make_interval(secs => $2)"
                        "      FROM command WHERE id = $1)",
                        command_id,
                        3 * ACK_WINDOW_S,
                    )
                )

            await wait_until(
                working_past_the_window, timeout=30, message="working, past the ack window"
            )
            during = await db.fetchrow(
                "SELECT status, retry_count, claim_generation FROM command WHERE id = $1",
                command_id,
            )
            finish.set()

            async def finished() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT count(*) FROM command_receipt"
                        " WHERE command_id = $1 AND result = 'ACKED'",
                        command_id,
                    )
                )

            await wait_until(finished, timeout=30, message="the device's ACKED stored")
        row = await db.fetchrow("SELECT status FROM command WHERE id = $1", command_id)
        receipts = [
            tuple(r)
            for r in await db.fetch(
                "SELECT result, outcome, raw_ack FROM command_receipt WHERE command_id = $1"
                " ORDER BY id",
                command_id,
            )
        ]
    finally:
        device.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
            await device
        await db.close()
    assert tuple(during) == ("SENT", 0, 1), f"judged though it answered: {receipts}"
    assert row["status"] == "ACKED", receipts
    assert [r[:2] for r in receipts] == [("SENT", "accepted"), ("ACKED", "accepted")], receipts
