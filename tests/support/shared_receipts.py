"""Two nodes of a `$share` group and one device: a realtime command SENT, with the device's next
receipt steered to node B.

mosquitto round-robins a shared subscription's messages over its members (disconnected
persistent sessions included): receipts for no command are published until one is stored by
node A (kept, refused), so that the next one, the device's answer, goes to node B. Used by the
tests where B cannot store or cannot receive that answer for a while.
"""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg

from gateway.domain.command import Delivery
from protocol import CommandReceipt, DownlinkCommand, ReceiptResult, Topics
from protocol.codec import decode_command, encode_receipt
from tests.support.commands import new_command
from tests.support.waiting import wait_until

# The first reported command id of the probes (no command has it).
PROBE_IDS = range(900_001, 900_011)


async def _stored_by(db: asyncpg.Connection, reported: int) -> str | None:
    value = await db.fetchval(
        "SELECT received_by FROM command_receipt WHERE reported_command_id = $1", reported
    )
    return None if value is None else str(value)


async def steer_next_receipt_to_b(
    db: asyncpg.Connection, device: aiomqtt.Client, topics: Topics, device_id: str
) -> None:
    """Publish receipts for no command until node-a stores one (the round robin's next member
    is then node-b)."""
    for probe in PROBE_IDS:
        await device.publish(
            topics.acks(device_id),
            encode_receipt(
                CommandReceipt(
                    command_id=probe, claim_generation=1, node_id="nobody",
                    result=ReceiptResult.ACKED,
                )
            ),
            qos=1,
        )  # fmt: skip
        holder: list[str] = []

        async def stored(probe: int = probe, holder: list[str] = holder) -> bool:
            by = await _stored_by(db, probe)
            if by is not None:
                holder.append(by)
            return by is not None

        await wait_until(stored, timeout=30, message=f"probe {probe} stored")
        if holder[-1] == "node-a":
            return
    raise AssertionError("no probe receipt went to node-a")


async def realtime_command_sent(
    db: asyncpg.Connection, device: aiomqtt.Client, device_id: str
) -> tuple[int, DownlinkCommand]:
    """A realtime command created for ``device_id`` (which subscribed to its commands), its
    downlink as the device received it, once the command is SENT."""
    created = await new_command(
        db, device_id=device_id, name="open", params={"valve": 2},
        delivery=Delivery.REALTIME, node_id="test",
    )  # fmt: skip
    command_id = created.command.id
    async with asyncio.timeout(30):
        message = await anext(device.messages)
    downlink = decode_command(bytes(message.payload))  # type: ignore[arg-type]

    async def sent() -> bool:
        return bool(
            await db.fetchval("SELECT status = 'SENT' FROM command WHERE id = $1", command_id)
        )

    await wait_until(sent, timeout=30, message="the command SENT")
    return command_id, downlink


async def device_answers(
    device: aiomqtt.Client,
    topics: Topics,
    device_id: str,
    command_id: int,
    downlink: DownlinkCommand,
) -> None:
    """The device's ACKED receipt to the claim its downlink carried."""
    await device.publish(
        topics.acks(device_id),
        encode_receipt(
            CommandReceipt(
                command_id=command_id, claim_generation=downlink.claim_generation,
                node_id=downlink.node_id, result=ReceiptResult.ACKED, result_code=0,
            )
        ),
        qos=1,
    )  # fmt: skip


async def wait_answer_stored(db: asyncpg.Connection, command_id: int) -> None:
    """Until the device's own receipt (no ``raw_ack``: not a node's) is stored, by any node."""

    async def stored() -> bool:
        return bool(
            await db.fetchval(
                "SELECT count(*) FROM command_receipt WHERE command_id = $1 AND raw_ack IS NULL",
                command_id,
            )
        )

    await wait_until(stored, timeout=30, message="the device's receipt stored")
