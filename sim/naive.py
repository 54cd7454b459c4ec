"""BASELINE ONLY — the naive consumer the gateway is measured against.

It does what a first attempt would: for each message decode it, insert it in its own
autocommit transaction, then acknowledge it. Correct (acked after commit, idempotent by event
id) but one round trip and one commit per message. Never use it for real ingest.
"""

from __future__ import annotations

import time

import aiomqtt
import asyncpg
import msgspec

from protocol import Topics, decode_telemetry, telemetry_event_id
from sim.sql import blocks

INSERT_ONE = blocks("naive.sql")["insert_one"]


async def naive_drain(
    *, host: str, port: int, client_id: str, topic: str, dsn: str, count: int, topics: Topics
) -> float:
    """Consume ``count`` messages from a prepared persistent session, one commit each.

    Returns the seconds from the first message's arrival to the last one's commit.
    """
    conn = await asyncpg.connect(dsn)
    try:
        client = aiomqtt.Client(
            host,
            port,
            identifier=client_id,
            protocol=aiomqtt.ProtocolVersion.V311,
            clean_session=False,
        )
        client._client.manual_ack_set(True)
        async with client:
            await client.subscribe(topic, qos=1)
            done = 0
            first = 0.0
            async for message in client.messages:
                if not done:
                    first = time.perf_counter()
                assert isinstance(message.payload, bytes)
                device_id = topics.parse_device_topic(message.topic.value).device_id
                decoded = decode_telemetry(message.payload)
                await conn.execute(
                    INSERT_ONE,
                    telemetry_event_id(device_id, decoded),
                    device_id,
                    decoded.timestamp(),
                    decoded.seq,
                    msgspec.json.encode(decoded.metrics).decode(),
                    "naive",
                )
                client._client.ack(message.mid, message.qos)
                done += 1
                if done == count:
                    return time.perf_counter() - first
    finally:
        await conn.close()
    raise RuntimeError(f"the message stream ended after {done} of {count} messages")
