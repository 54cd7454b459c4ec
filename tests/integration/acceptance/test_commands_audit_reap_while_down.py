"""The reaper judges a receipt missing only if its node heard for the whole ack window, up to
the pass that judges it, even a pass that asked how long it had heard before it had to wait.

A reaper pass asked how long the node had heard (its broker session subscribed without a
break), then waited for a pooled database connection (a busy pool: an ingest burst, a slow
database) and judged with that answer. The session could go down during the wait: the pass
then judged commands whose ack window ended while the node heard nothing, and timed out one
whose device had answered, its receipt waiting at the broker for the node's session (a
realtime command FAILED, a deferrable one sent again; the device's receipt, when the session
came back, kept as ``duplicated``).

Forced deterministically with a real mosquitto behind a TCP proxy, the real daemon and a
device (a plain client on the broker): the test takes every connection of the node's pool
while a SENT command's window runs, cuts the link while the reaper's pass waits, the device
answers, the window ends, and then the test gives the pool back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiomqtt
import asyncpg
import pytest

from gateway.commands import reaper as reaper_module
from gateway.commands.reaper import Reaper
from gateway.domain.command import Delivery
from protocol import CommandReceipt, ReceiptResult, Topics, decode_command, encode_receipt
from tests.support.commands import new_command
from tests.support.daemon import make_config, running_daemon, session_down, session_up
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
DEVICE = "pump-1"
ACK_WINDOW_S = 3.0
COMMANDS = f"[commands]\nack_window_s = {ACK_WINDOW_S}\nreaper_interval_s = 0.2\n"


class Passes:
    """The node's reaper passes, counted: begun, over, and how many reached ``reap``."""

    def __init__(self) -> None:
        self.begun = 0
        self.over = 0
        self.reaped = 0


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> Passes:
    counted = Passes()
    run_once: Callable[[Reaper], Any] = Reaper.run_once
    reap = reaper_module.reap

    async def counted_pass(self: Reaper) -> None:
        counted.begun += 1
        try:
            await run_once(self)
        finally:
            counted.over += 1

    async def counted_reap(*args: Any, **kwargs: Any) -> Any:
        counted.reaped += 1
        return await reap(*args, **kwargs)

    monkeypatch.setattr(Reaper, "run_once", counted_pass)
    monkeypatch.setattr(reaper_module, "reap", counted_reap)
    return counted


async def test_a_pass_that_waited_for_a_connection_judges_nothing_once_the_session_went_down(
    db_dsn: str, mosquitto: Mosquitto, passes: Passes
) -> None:
    db = await asyncpg.connect(db_dsn)
    downlinks: list[bytes] = []
    try:
        async with (
            aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="device") as device,
            TcpProxy("127.0.0.1", mosquitto.port) as proxy,
        ):
            await device.subscribe(TOPICS.commands(DEVICE), qos=1)

            async def listen() -> None:
                async for message in device.messages:
                    assert isinstance(message.payload, bytes)
                    downlinks.append(message.payload)

            listening = asyncio.create_task(listen())
            config = make_config(dsn=db_dsn, mqtt_port=proxy.port, node_id="node-a", extra=COMMANDS)
            async with running_daemon(config) as daemon:
                assert daemon.components is not None
                reaper = daemon.components.reaper

                # The node has heard for a whole window: a pass may judge a missing receipt.
                await wait_until(
                    lambda: reaper.heard_for_s() > ACK_WINDOW_S,
                    timeout=30, message="heard for an ack window",
                )  # fmt: skip
                created = await new_command(
                    db, device_id=DEVICE, name="open", params={"valve": 2},
                    delivery=Delivery.REALTIME, idempotency_key=None, actor="test",
                    node_id="test", expire_after_s=3600,
                )  # fmt: skip
                command_id = created.command.id

                async def sent() -> bool:
                    status = await db.fetchval(
                        "SELECT status FROM command WHERE id = $1", command_id
                    )
                    return status == "SENT" and len(downlinks) == 1

                await wait_until(sent, timeout=30, message="the downlink sent, at the device")
                downlink = decode_command(downlinks[0])
                pool = daemon.pool
                assert pool is not None
                async with contextlib.AsyncExitStack() as taken:
                    for _ in range(pool.get_max_size()):
                        await taken.enter_async_context(pool.acquire())
                    reaped = passes.reaped
                    # A pass began (its interval) and waits for a connection, before reaping.
                    await wait_until(
                        lambda: passes.begun == passes.over + 1 and passes.reaped == reaped,
                        timeout=30, message="a reaper pass waiting for a connection",
                    )  # fmt: skip
                    waiting = passes.begun
                    await proxy.cut()
                    await wait_until(
                        lambda: session_down(daemon), timeout=30, message="session down"
                    )
                    # The device answers within its window: the receipt waits at the broker
                    # for the node's session.
                    receipt = CommandReceipt(
                        command_id=command_id,
                        claim_generation=downlink.claim_generation,
                        node_id=downlink.node_id,
                        result=ReceiptResult.ACKED,
                        result_code=0,
                    )
                    await device.publish(TOPICS.acks(DEVICE), encode_receipt(receipt), qos=1)

                    async def window_over() -> bool:
                        return bool(
                            await db.fetchval(
                                "SELECT now() - sent_at > make_interval(secs => $2)"
                                " FROM command WHERE id = $1",
                                command_id,
                                ACK_WINDOW_S,
                            )
                        )

                    await wait_until(window_over, timeout=30, message="the ack window over")
                # The pool free again: the waiting pass goes on, and is over.
                await wait_until(
                    lambda: passes.over >= waiting, timeout=30, message="the waiting pass over"
                )
                during = await db.fetchval("SELECT status FROM command WHERE id = $1", command_id)
                # The link back: the device's receipt, held by the broker, comes in.
                await proxy.resume()
                await wait_until(lambda: session_up(daemon), timeout=30, message="session back")

                async def answered() -> bool:
                    count = await db.fetchval(
                        "SELECT count(*) FROM command_receipt WHERE command_id = $1"
                        " AND raw_ack IS NULL",
                        command_id,
                    )
                    return bool(count)

                await wait_until(answered, timeout=30, message="the device's receipt stored")
                row = await db.fetchrow(
                    "SELECT status, result FROM command WHERE id = $1", command_id
                )
                receipts = [
                    tuple(r)
                    for r in await db.fetch(
                        "SELECT result, outcome, raw_ack FROM command_receipt"
                        " WHERE command_id = $1 ORDER BY id",
                        command_id,
                    )
                ]
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening
    finally:
        await db.close()
    assert during == "SENT", f"judged while the session was down: {during}; {receipts}"
    assert (row["status"], row["result"]) == ("ACKED", "ACKED"), receipts
    assert [r[1] for r in receipts] == ["accepted"], receipts
