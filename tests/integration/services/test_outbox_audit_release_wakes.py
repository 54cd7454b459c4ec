"""An event released by a publisher whose broker session went down mid-batch (SessionDown) is
NOTIFYed: another node's publisher, whose session is up, takes it at once.

The release sent no NOTIFY (only an insert does, by trigger), so the other nodes took the
released event at their next poll: with a long ``poll_s`` (the NOTIFY does the waking), an
alarm's creation stayed unpublished while a node with a working session sat idle. Two
publishers on one real PostgreSQL, each LISTENing through its own loop; the other one's poll is
an hour, so only a NOTIFY can wake it in time."""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.outbox.publisher import OutboxPublisher
from gateway.support.broker_link import BrokerLink, SessionDown
from gateway.support.metrics import Metrics
from protocol import Topics
from storage import outbox
from tests.support.waiting import wait_until

HOUR_S = 3600.0


async def test_an_event_released_by_a_node_whose_session_dropped_is_taken_by_another_at_once(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    async with pool.acquire() as conn:
        await outbox.add_event(
            conn, aggregate_type="alarm", aggregate_id="1", event_type="e0", payload={"n": 0}
        )
    # Node 1: claims the event, and its session drops while the publish is under way.
    publishing = asyncio.Event()
    drop = asyncio.Event()

    async def dropped(_topic: str, _payload: bytes) -> int:
        publishing.set()
        await drop.wait()
        raise SessionDown("the broker connection ended")

    first = OutboxPublisher(
        pool=pool, dsn=db_dsn, node_id="n1", topics=Topics("iot"), publish=dropped,
        metrics=Metrics(), poll_s=HOUR_S, broker=BrokerLink(),
    )  # fmt: skip
    # Node 2: its session is up all along; it polls once an hour.
    sent: list[str] = []

    async def publish(topic: str, _payload: bytes) -> int:
        sent.append(topic)
        return 0

    second = OutboxPublisher(
        pool=pool, dsn=db_dsn, node_id="n2", topics=Topics("iot"), publish=publish,
        metrics=Metrics(), poll_s=HOUR_S, broker=BrokerLink(),
    )  # fmt: skip
    passes: list[int] = []
    its_pass = second.run_once

    async def counted() -> int:
        claimed = await its_pass()
        passes.append(claimed)
        return claimed

    second.run_once = counted  # type: ignore[method-assign]

    batch = asyncio.create_task(first.run_once())
    await wait_until(publishing.is_set, timeout=10, message="node 1 publishing its batch")
    stop = asyncio.Event()
    loop = asyncio.create_task(second.run(stop))
    try:
        # Node 2 looked (LISTENing from before its first pass), found the event leased, waits.
        await wait_until(lambda: passes == [0], timeout=10, message="node 2's first pass")
        drop.set()
        assert await batch == 1
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT lease_owner FROM outbox_event") in ("n2", None)
        await wait_until(
            lambda: sent == ["iot/events/alarm/1"],
            timeout=10,
            message="node 2 publishing the released event before its poll",
        )
    finally:
        stop.set()
        await loop
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT status, retry_count FROM outbox_event")
    assert row is not None
    assert tuple(row) == ("PUBLISHED", 0)
