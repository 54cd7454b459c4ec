"""Fast QoS 1 publishing: many publishes in flight, each awaited for its PUBACK."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiomqtt


async def publish_many(
    client: aiomqtt.Client,
    messages: Iterable[tuple[str, bytes]],
    *,
    qos: int = 1,
    window: int = 256,
) -> int:
    """Publish every (topic, payload); at most ``window`` unacknowledged at once.

    Returns how many were published. Raises the first publish error (the rest are
    cancelled); the broker has then acknowledged every message before the failing one
    only if it answers in order, so callers that need exactly-once retry with the same
    payloads and rely on the gateway's event ids.
    """
    slots = asyncio.Semaphore(window)
    count = 0
    # aiomqtt warns once more than this many publishes wait for their PUBACK; we mean it.
    client.pending_calls_threshold = window + 1

    async def one(topic: str, payload: bytes) -> None:
        try:
            await client.publish(topic, payload, qos=qos)
        finally:
            slots.release()

    async with asyncio.TaskGroup() as tasks:
        for topic, payload in messages:
            await slots.acquire()
            tasks.create_task(one(topic, payload))
            count += 1
    return count
