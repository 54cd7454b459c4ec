"""The embedded amqtt broker: QoS 1 delivery, a taken port, an idempotent stop."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import aiomqtt
import pytest

from gateway.embedded.broker import EmbeddedBroker, EmbeddedBrokerError
from tests.support.ports import free_port

pytestmark = pytest.mark.embedded


async def test_a_qos1_publish_reaches_a_qos1_subscriber(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    port = free_port()
    async with (
        EmbeddedBroker("127.0.0.1", port) as broker,
        aiomqtt.Client(broker.host, broker.port, identifier="sub") as subscriber,
        aiomqtt.Client(broker.host, broker.port, identifier="pub") as publisher,
    ):
        await subscriber.subscribe("iot/dev-1/telemetry", qos=1)  # returns after SUBACK
        await publisher.publish("iot/dev-1/telemetry", b'{"temp": 21.5}', qos=1)

        async with asyncio.timeout(5):
            message = await anext(subscriber.messages)

    assert message.topic.value == "iot/dev-1/telemetry"
    assert message.payload == b'{"temp": 21.5}'
    assert message.qos == 1
    # No persistence files in the working directory.
    assert await asyncio.to_thread(lambda: list(tmp_path.iterdir())) == []
    assert logging.getLogger("amqtt").getEffectiveLevel() >= logging.WARNING


async def test_a_taken_port_is_a_clear_error() -> None:
    port = free_port()
    async with EmbeddedBroker("127.0.0.1", port):
        with pytest.raises(EmbeddedBrokerError) as raised:
            await EmbeddedBroker("127.0.0.1", port).start()
    assert str(raised.value) == (
        f"port {port} on 127.0.0.1 is already in use: set [mqtt] host to use that broker, "
        "or [mqtt] port to move the embedded one"
    )


async def test_a_port_taken_by_another_program_is_the_same_error() -> None:
    with socket.socket() as other:
        # A wildcard listener also owns the loopback port.
        other.bind(("0.0.0.0", 0))  # noqa: S104 - the wildcard listener is the point
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(EmbeddedBrokerError, match=f"port {port} on 127.0.0.1 is already"):
            await EmbeddedBroker("127.0.0.1", port).start()


async def test_stop_is_idempotent_and_frees_the_port() -> None:
    broker = EmbeddedBroker("127.0.0.1", free_port())
    await broker.stop()  # never started
    await broker.start()
    await broker.stop()
    await broker.stop()
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((broker.host, broker.port))
    await broker.start()  # and it can start again
    await broker.stop()


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1", "::", "::1", "broker.example"])  # noqa: S104 - addresses the broker must refuse
def test_only_ipv4_loopback_or_localhost_is_accepted(host: str) -> None:
    with pytest.raises(EmbeddedBrokerError, match="loopback"):
        EmbeddedBroker(host)


async def test_localhost_is_served() -> None:
    async with (
        EmbeddedBroker("localhost", free_port()) as broker,
        aiomqtt.Client("localhost", broker.port) as client,
    ):
        await client.subscribe("iot/#", qos=1)
