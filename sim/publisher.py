"""Fast QoS 1 publishing: many publishes in flight, each awaited for its PUBACK."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from typing import Any

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


def no_delay(client: aiomqtt.Client) -> None:
    """Send small packets at once (TCP_NODELAY) on a connected client; paho leaves Nagle's
    algorithm on, which holds a receipt back until the broker's delayed ACK (40 ms)."""
    sock: Any = client._client.socket()
    if sock is not None and getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
