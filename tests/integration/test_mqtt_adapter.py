"""The manual-ack adapter: unacknowledged QoS 1 messages come back, acknowledged ones do not."""

from __future__ import annotations

import asyncio
import socket

import aiomqtt
import pytest

from gateway.mqtt import AckingClient, ConnectionSettings
from tests.support.mosquitto import Mosquitto

TOPIC = "iot/devices/dev-1/telemetry"


def _settings(port: int, protocol: str) -> ConnectionSettings:
    return ConnectionSettings(
        host="127.0.0.1",
        port=port,
        client_id=f"adapter-{protocol}",
        protocol=protocol,  # type: ignore[arg-type]
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
