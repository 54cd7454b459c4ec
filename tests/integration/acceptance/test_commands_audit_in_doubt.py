"""A downlink written to the broker whose PUBACK never came back before the connection died.

The broker took it and delivered it; the device carried it out and answered. The gateway's
session then went down before the PUBACK (or the receipt) reached it: the link to the broker
died right after the PUBLISH was written. Whatever the gateway does next, it must not send the
device the same command a second time while the device's answer to the first is on its way,
nor refuse that answer.

The outage is forced through a TCP proxy between the gateway and a real mosquitto: what the
broker sends the gateway is dropped (the PUBACK, the receipt), then the connection is cut and
the proxy listens again. The device is a real MQTT client on the broker itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

import aiomqtt
import asyncpg
import msgspec

from gateway.commands.lifecycle import DISPATCHER_ACTOR
from gateway.domain.command import Delivery
from gateway.runtime.daemon import Daemon
from protocol import Topics
from tests.support.commands import new_command
from tests.support.daemon import make_config, running_daemon, session_down, session_up
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
DEVICE = "valve-1"
COMMANDS = "[commands]\nlease_s = 30\nack_window_s = 60\nreaper_interval_s = 0.2\n"
# The second test waits for the ack window: short, still far above a receipt's round trip.
SHORT_WINDOW = "[commands]\nlease_s = 30\nack_window_s = 2\nreaper_interval_s = 0.2\n"


class Device:
    """A device that carries out every downlink it gets and answers ACKED, echoing the claim."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.downlinks: list[tuple[int, int]] = []  # (commandId, claimGeneration) as received
        self.subscribed = asyncio.Event()

    async def run(self) -> None:
        async with aiomqtt.Client(
            "127.0.0.1", self.port, identifier="valve-1-device", clean_session=False
        ) as client:
            await client.subscribe(TOPICS.commands(DEVICE), qos=1)
            self.subscribed.set()
            async for message in client.messages:
                body = msgspec.json.decode(bytes(message.payload))  # type: ignore[arg-type]
                self.downlinks.append((body["commandId"], body["claimGeneration"]))
                receipt = {
                    "commandId": body["commandId"],
                    "claimGeneration": body["claimGeneration"],
                    "nodeId": body["nodeId"],
                    "result": "ACKED",
                    "resultCode": 0,
                }
                await client.publish(TOPICS.acks(DEVICE), msgspec.json.encode(receipt), qos=1)


async def _cut_and_back(proxy: TcpProxy, daemon: Daemon, *, wait_up: bool = True) -> None:
    """The link cut (the daemon's session sees it down), the proxy's filters dropped, the link
    back (and, with ``wait_up``, the session up and subscribed again)."""
    await proxy.cut()
    await wait_until(lambda: session_down(daemon), timeout=30, message="session down")
    proxy.from_server = None
    proxy.from_client = None
    await proxy.resume()
    if wait_up:
        await wait_until(lambda: session_up(daemon), timeout=30, message="session back")


async def test_a_downlink_whose_puback_was_lost_with_the_link_is_not_carried_out_twice(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    device = Device(mosquitto.port)
    running = asyncio.create_task(device.run())
    db = await asyncpg.connect(db_dsn)
    try:
        await asyncio.wait_for(device.subscribed.wait(), 30)
        async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
            config = make_config(dsn=db_dsn, mqtt_port=proxy.port, node_id="node-a", extra=COMMANDS)
            async with running_daemon(config) as daemon:
                # From now on nothing the broker sends reaches the gateway: the downlink's
                # PUBACK is lost on the way, as when the link dies right after the PUBLISH.
                proxy.from_server = lambda _data: False
                created = await new_command(
                    db, device_id=DEVICE, name="dispense", params={"ml": 10},
                    delivery=Delivery.REALTIME, idempotency_key=None, actor="test",
                    node_id="test", expire_after_s=3600,
                )  # fmt: skip
                command_id = created.command.id
                await wait_until(
                    lambda: len(device.downlinks) == 1, timeout=30,
                    message="the device got the downlink and answered it",
                )  # fmt: skip
                # The device's receipt is at the broker, for the gateway's session. The link
                # dies now, before the PUBACK got through.
                await _cut_and_back(proxy, daemon)

                async def finished() -> bool:
                    status = await db.fetchval(
                        "SELECT status FROM command WHERE id = $1", command_id
                    )
                    return status in ("ACKED", "FAILED", "TIMEOUT", "CANCELLED")

                await wait_until(finished, timeout=30, message="the command finished")
                # Whatever came after (a second downlink and its answer) has settled too.
                await wait_until(
                    lambda: _receipts_settled(db, command_id, len(device.downlinks)),
                    timeout=30, message="every receipt stored",
                )  # fmt: skip
        row = await db.fetchrow(
            "SELECT status, claim_generation FROM command WHERE id = $1", command_id
        )
        receipts = [
            tuple(r)
            for r in await db.fetch(
                "SELECT claim_generation, outcome, reason FROM command_receipt"
                " WHERE command_id = $1 ORDER BY id",
                command_id,
            )
        ]
        audit = [
            tuple(r)
            for r in await db.fetch(
                "SELECT action, from_status, to_status, claim_generation, note"
                " FROM command_audit WHERE command_id = $1 ORDER BY id",
                command_id,
            )
        ]
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
            await running
        await db.close()
    trail = f"downlinks {device.downlinks}; receipts {receipts}; audit {audit}"
    # The device carried the command out once, and its answer to that downlink counted.
    assert device.downlinks == [(command_id, 1)], f"sent to the device again: {trail}"
    assert (row["status"], row["claim_generation"]) == ("ACKED", 1), trail
    assert receipts[0] == (1, "accepted", None), trail


async def _receipts_settled(db: asyncpg.Connection, command_id: int, downlinks: int) -> bool:
    stored = await db.fetchval(
        "SELECT count(*) FROM command_receipt WHERE command_id = $1", command_id
    )
    return bool(stored >= downlinks)


async def test_a_downlink_in_doubt_the_broker_never_got_goes_again_after_the_ack_window(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """The other side of the doubt: the PUBLISH never reached the broker. Nothing is lost: no
    receipt comes, the ack window passes (counted from the reconnect), and a deferrable command
    goes again, on a new claim."""
    device = Device(mosquitto.port)
    running = asyncio.create_task(device.run())
    db = await asyncpg.connect(db_dsn)
    try:
        await asyncio.wait_for(device.subscribed.wait(), 30)
        async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
            config = make_config(
                dsn=db_dsn, mqtt_port=proxy.port, node_id="node-a", extra=SHORT_WINDOW
            )
            async with running_daemon(config) as daemon:
                written = asyncio.Event()

                def swallow(data: bytes) -> bool:
                    if TOPICS.commands(DEVICE).encode() in data:
                        written.set()  # the downlink, written by the gateway, lost on the way
                    return False

                proxy.from_client = swallow
                created = await new_command(
                    db, device_id=DEVICE, name="dispense", params={"ml": 10},
                    delivery=Delivery.DEFERRABLE, idempotency_key=None, actor="test",
                    node_id="test", expire_after_s=3600,
                )  # fmt: skip
                command_id = created.command.id
                await asyncio.wait_for(written.wait(), 30)
                await _cut_and_back(proxy, daemon)

                async def acked() -> bool:
                    status = await db.fetchval(
                        "SELECT status FROM command WHERE id = $1", command_id
                    )
                    return bool(status == "ACKED")

                await wait_until(acked, timeout=30, message="the command ACKED")
        row = await db.fetchrow(
            "SELECT claim_generation, retry_count, reclaim_count FROM command WHERE id = $1",
            command_id,
        )
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
            await running
        await db.close()
    assert device.downlinks == [(command_id, 2)]
    assert tuple(row) == (2, 1, 0)


TASMOTA = '[[ingest.mappings]]\nname = "tasmota"\nprofile = "tasmota"\n'


async def test_a_mapped_device_downlink_in_doubt_goes_again(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """A vendor device (an [[ingest.mappings]] one) answers no receipt, and the ack window
    spares it: a downlink of its in doubt would wait SENT for a day, never delivered. It is
    released and goes again, as before."""
    db = await asyncpg.connect(db_dsn)
    try:
        async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
            config = make_config(
                dsn=db_dsn, mqtt_port=proxy.port, node_id="node-a", extra=TASMOTA + COMMANDS
            )
            async with (
                running_daemon(config) as daemon,
                aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="kitchen") as device,
            ):
                await device.subscribe("cmnd/kitchen/#", qos=1)
                # Seen through the mapping first: its commands go out on Tasmota's topic.
                at = datetime.now(UTC).replace(microsecond=0, tzinfo=None).isoformat()
                reading = f'{{"Time": "{at}", "AM2301": {{"Temperature": 21.5}}}}'
                await device.publish("tele/kitchen/SENSOR", reading.encode(), qos=1)

                async def mapped() -> bool:
                    return bool(
                        await db.fetchval(
                            "SELECT count(*) FROM device_mapping WHERE device_id = 'kitchen'"
                        )
                    )

                await wait_until(mapped, timeout=30, message="kitchen seen through tasmota")
                written = asyncio.Event()

                def swallow(data: bytes) -> bool:
                    if b"cmnd/kitchen/POWER" in data:
                        written.set()  # written by the gateway, lost on the way
                    return False

                proxy.from_client = swallow
                created = await new_command(
                    db, device_id="kitchen", name="POWER", params={"value": "ON"},
                    delivery=Delivery.REALTIME, idempotency_key=None, actor="test",
                    node_id="test", expire_after_s=3600,
                )  # fmt: skip
                await asyncio.wait_for(written.wait(), 30)
                await _cut_and_back(proxy, daemon, wait_up=False)
                async with asyncio.timeout(30):
                    message = await anext(aiter(device.messages))
                assert (message.topic.value, message.payload) == ("cmnd/kitchen/POWER", b"ON")
        row = await db.fetchrow(
            "SELECT claim_generation, reclaim_count FROM command WHERE id = $1",
            created.command.id,
        )
        returned = await db.fetch(
            "SELECT actor FROM command_audit WHERE command_id = $1"
            " AND from_status = 'CLAIMED' AND to_status = 'PENDING' ORDER BY id",
            created.command.id,
        )
    finally:
        await db.close()
    # Released, never reclaimed: every claim before the one that carried it went back by the
    # dispatcher's own release, none by the reaper. Usually one (the claim in doubt); CI once
    # saw two, the second claimed while the session came back and released unpublished
    # ("broker session down: not published, not a reclaim"), which changes nothing here.
    assert row["reclaim_count"] == 0
    assert row["claim_generation"] >= 2
    assert [r["actor"] for r in returned] == [DISPATCHER_ACTOR] * (row["claim_generation"] - 1)
