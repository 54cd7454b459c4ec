"""BASELINE ONLY — the naive consumer the gateway is measured against.

It does what a first attempt would: for each message decode it, insert it in its own
autocommit transaction, then acknowledge it. Correct (acked after commit, idempotent by event
id) but one round trip and one commit per message. Never use it for real ingest.
"""

from __future__ import annotations

import asyncio
from importlib import resources

import aiomqtt
import asyncpg
import msgspec

from protocol import Topics, decode_telemetry, telemetry_event_id

INSERT_ONE = "\n".join(
    line
    for line in resources.files("sim").joinpath("naive.sql").read_text().splitlines()
    if not line.startswith("--")
)


async def naive_drain(
    *, host: str, port: int, client_id: str, topic: str, dsn: str, count: int, topics: Topics
) -> None:
    """Consume ``count`` messages from a prepared persistent session, one commit each."""
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
            async for message in client.messages:
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
                    return
    finally:
        await conn.close()


def run(**kwargs: object) -> None:
    asyncio.run(naive_drain(**kwargs))  # type: ignore[arg-type]
