"""The manual-ack adapter: unacknowledged QoS 1 messages come back, acknowledged ones do not;
reading pauses on a full buffer, counted in messages or in bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import aiomqtt
import pytest

from gateway.mqtt.v311_client import AckingClient, ConnectionSettings
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPIC = "iot/devices/dev-1/telemetry"


def _settings(port: int, protocol: str) -> ConnectionSettings:
    return ConnectionSettings(
        host="127.0.0.1",
        port=port,
        client_id=f"adapter-{protocol}",
        protocol=protocol,  # type: ignore[arg-type]  # a Literal from a parameter
        persistent_session=True,
        session_expiry_s=600,
        receive_maximum=100,
    )


async def _receive(client: AckingClient, count: int) -> list[aiomqtt.Message]:
    received: list[aiomqtt.Message] = []
    async with asyncio.timeout(20):
        async for message in client.messages:
            received.append(message)
            if len(received) == count:
                return received
    raise AssertionError("message stream ended")


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_only_acknowledged_messages_are_not_redelivered(
    mosquitto: Mosquitto, protocol: str
) -> None:
    settings = _settings(mosquitto.port, protocol)
    async with AckingClient(settings) as consumer:
        await consumer.subscribe(TOPIC, qos=1)
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as publisher:
        for n in range(10):
            await publisher.publish(TOPIC, f"m{n}".encode(), qos=1)

        async with AckingClient(settings) as consumer:
            first = await _receive(consumer, 10)
            assert [m.payload for m in first] == [f"m{n}".encode() for n in range(10)]
            for message in first[:5]:
                assert consumer.ack(message)

        # Reconnect with the same session: the five unacknowledged come back first.
        async with AckingClient(settings) as consumer:
            await publisher.publish(TOPIC, b"marker", qos=1)
            again = await _receive(consumer, 6)
            assert [m.payload for m in again] == [
                *(f"m{n}".encode() for n in range(5, 10)),
                b"marker",
            ]
            for message in again:
                assert consumer.ack(message)
            stale = again[0]

        assert not consumer.ack(stale)  # closed connection: a no-op, never a wrong ack

        async with AckingClient(settings) as consumer:
            await publisher.publish(TOPIC, b"after", qos=1)
            (only,) = await _receive(consumer, 1)
            assert only.payload == b"after"
            assert consumer.ack(only)


async def test_small_packets_go_out_at_once(mosquitto: Mosquitto) -> None:
    """TCP_NODELAY: a PUBACK or a downlink is not held back for the peer's delayed ACK."""
    async with AckingClient(_settings(mosquitto.port, "5")) as client:
        sock = client.client._client.socket()
        assert sock is not None
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_reading_pauses_on_buffered_bytes_as_well_as_on_messages(
    mosquitto: Mosquitto,
) -> None:
    bound, size, count = 200_000, 50_000, 20
    settings = dataclasses.replace(
        _settings(mosquitto.port, "5"), buffer_high=1000, buffer_high_bytes=bound
    )
    paused: list[str] = []
    async with AckingClient(settings, on_pause=paused.append) as consumer:
        await consumer.subscribe(TOPIC, qos=1)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as publisher:
            for n in range(count):
                await publisher.publish(TOPIC, bytes([n]) * size, qos=1)
        # Far below the message bound, the bytes stop the reading.
        await wait_until(lambda: consumer.reading_paused, timeout=20, message="reading paused")
        assert paused == ["bytes"]
        assert consumer.pauses_by_bound == {"messages": 0, "bytes": 1}
        assert consumer.buffered == bound // size
        assert consumer.buffered_bytes == bound
        # Taking messages resumes it, pausing again as the buffer refills; nothing is lost.
        received = await _receive(consumer, count)
        assert [m.payload for m in received] == [bytes([n]) * size for n in range(count)]
        assert consumer.pauses_by_bound["bytes"] >= 2
        assert consumer.buffered_bytes == 0
        for message in received:
            assert consumer.ack(message)
