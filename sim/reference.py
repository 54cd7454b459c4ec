"""BASELINE ONLY — the minimal exactly-once consumer the gateway's drain is measured against.

What any consumer must do and nothing more: MQTT 5 on the `mqtt5` codec over an asyncio
Protocol, a persistent session, each batch of what arrived (up to ``batch_max``) decoded with
msgspec, its SHA-256 event ids computed, inserted with one `INSERT … SELECT FROM unnest(…) ON
CONFLICT DO NOTHING` and committed, and only then PUBACKed, all in one write. No rules, no
dead letters, no presence, no receipts, no reconnects: a broken connection or an undecodable
message ends the run. Never use it for real ingest.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

import asyncpg
import mqtt5
import msgspec

from protocol import Topics, checked_device_event_id, decode_telemetry
from sim.sql import blocks

INSERT_BATCH = blocks("reference.sql")["insert_batch"]
_METRICS = msgspec.json.Encoder()


class _Session(asyncio.Protocol):
    """One connection: packets in, PUBACKs out; publishes queue for the consumer."""

    def __init__(self, receive_max: int) -> None:
        self.receive_max = receive_max
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.publishes: list[mqtt5.PublishPacket] = []
        self.arrived = asyncio.Event()
        self.connack: asyncio.Future[mqtt5.ConnAckPacket] = asyncio.Future()
        self.suback: asyncio.Future[mqtt5.SubAckPacket] = asyncio.Future()
        self.lost: asyncio.Future[None] = asyncio.Future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        view = memoryview(buffer)
        offset = 0
        try:
            while offset < len(buffer):
                try:
                    packet, size = mqtt5.read(view[offset:])
                except IndexError:  # an incomplete packet: wait for more bytes
                    break
                offset += size
                if isinstance(packet, mqtt5.PublishPacket):
                    self.publishes.append(packet)
                    self.arrived.set()
                elif isinstance(packet, mqtt5.ConnAckPacket):
                    self.connack.set_result(packet)
                elif isinstance(packet, mqtt5.SubAckPacket):
                    self.suback.set_result(packet)
        finally:
            view.release()
        del buffer[:offset]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.arrived.set()

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


async def _connect(host: str, port: int, client_id: str, receive_max: int) -> _Session:
    loop = asyncio.get_running_loop()
    _, session = await loop.create_connection(lambda: _Session(receive_max), host, port)
    session.write(
        mqtt5.ConnectPacket(
            client_id, clean_start=False, session_expiry_interval=3600, receive_max=receive_max
        ).write()
    )
    connack = await asyncio.wait_for(session.connack, 10)
    if connack.reason_code != mqtt5.ConnAckReasonCode.SUCCESS:
        raise RuntimeError(f"the broker refused the reference consumer: {connack.reason_code!r}")
    return session


def _close(session: _Session) -> None:
    session.write(mqtt5.DisconnectPacket().write())
    assert session.transport is not None
    session.transport.close()


async def reference_subscribe(
    *, host: str, port: int, client_id: str, topic: str, receive_max: int
) -> None:
    """Create the persistent session and its subscription, then go away (the backlog queues)."""
    session = await _connect(host, port, client_id, receive_max)
    session.write(
        mqtt5.SubscribePacket(
            1, [mqtt5.TopicFilter(topic, max_qos=mqtt5.QoS.AT_LEAST_ONCE)]
        ).write()
    )
    suback = await asyncio.wait_for(session.suback, 10)
    if any(int(code) >= 0x80 for code in suback.reason_codes):
        raise RuntimeError(f"subscription refused: {suback.reason_codes!r}")
    _close(session)


async def reference_drain(
    *,
    host: str,
    port: int,
    client_id: str,
    dsn: str,
    count: int,
    topics: Topics,
    receive_max: int,
    batch_max: int = 500,
) -> float:
    """Consume ``count`` messages queued for the session; the seconds from the first
    message's arrival to the last one's commit."""
    conn = await asyncpg.connect(dsn)
    session = await _connect(host, port, client_id, receive_max)
    try:
        done = 0
        first = 0.0
        while done < count:
            if not session.publishes:
                if session.lost.done():
                    raise RuntimeError(f"the connection ended after {done} of {count} messages")
                session.arrived.clear()
                await session.arrived.wait()
                continue
            if not done:
                first = time.perf_counter()
            batch = session.publishes[:batch_max]
            del session.publishes[:batch_max]
            ids, devices, stamps, seqs, metrics = [], [], [], [], []
            for packet in batch:
                # As the gateway's decoder does: the topic's parse checks the device id once.
                device_id = topics.split_device_topic(packet.topic)[1]
                message = decode_telemetry(packet.payload)
                ids.append(checked_device_event_id(device_id, message))
                devices.append(device_id)
                stamps.append(message.timestamp())
                seqs.append(message.seq)
                metrics.append(
                    None if message.metrics is None else _METRICS.encode(message.metrics).decode()
                )
            async with conn.transaction():
                await conn.execute(INSERT_BATCH, ids, devices, stamps, seqs, metrics)
            session.write(
                b"".join(
                    mqtt5.PubAckPacket(p.packet_id).write()
                    for p in batch
                    if p.packet_id is not None
                )
            )
            done += len(batch)
        return time.perf_counter() - first
    finally:
        _close(session)
        await conn.close()
