"""The test broker: a real mosquitto that keeps offline sessions across a clean restart."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiomqtt
import pytest

from tests.support.mosquitto import Mosquitto

RECEIVE_TIMEOUT_S = 10.0


async def _receive(client: aiomqtt.Client, count: int) -> list[bytes]:
    payloads: list[bytes] = []
    try:
        async with asyncio.timeout(RECEIVE_TIMEOUT_S):
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                payloads.append(message.payload)
                if len(payloads) == count:
                    break
    except TimeoutError:
        raise AssertionError(
            f"received {len(payloads)} of {count} messages within {RECEIVE_TIMEOUT_S}s"
        ) from None
    return payloads


async def _subscribe_persistently(broker: Mosquitto, identifier: str, topic: str) -> None:
    async with aiomqtt.Client(
        broker.host, broker.port, identifier=identifier, clean_session=False
    ) as subscriber:
        await subscriber.subscribe(topic, qos=1)


async def _publish(broker: Mosquitto, topic: str, payloads: list[bytes]) -> None:
    async with aiomqtt.Client(broker.host, broker.port, identifier="publisher") as publisher:
        for payload in payloads:
            await publisher.publish(topic, payload, qos=1)


async def test_publish_and_subscribe_at_qos_1(tmp_path: Path) -> None:
    with Mosquitto(tmp_path) as broker:
        async with aiomqtt.Client(
            broker.host, broker.port, identifier="subscriber", clean_session=False
        ) as subscriber:
            await subscriber.subscribe("devices/+/telemetry", qos=1)
            await _publish(broker, "devices/d1/telemetry", [b"hello"])

            [payload] = await _receive(subscriber, 1)

    assert payload == b"hello"
    assert "subscriber" in broker.log_tail()


async def test_offline_queue_survives_a_clean_restart(tmp_path: Path) -> None:
    sent = [f"m{i:03}".encode() for i in range(100)]
    with Mosquitto(tmp_path) as broker:
        await _subscribe_persistently(broker, "offline-consumer", "queue/test")
        await _publish(broker, "queue/test", sent)
        port = broker.port

        broker.restart()

        assert broker.port == port
        async with aiomqtt.Client(
            broker.host, broker.port, identifier="offline-consumer", clean_session=False
        ) as subscriber:
            received = await _receive(subscriber, len(sent))

    assert received == sent
    assert (tmp_path / "mosquitto.db").exists()


async def test_offline_queue_holds_more_than_the_mosquitto_default_of_1000(
    tmp_path: Path,
) -> None:
    sent = [f"m{i:05}".encode() for i in range(1500)]
    with Mosquitto(tmp_path) as broker:
        await _subscribe_persistently(broker, "offline-consumer", "queue/test")
        await _publish(broker, "queue/test", sent)

        async with aiomqtt.Client(
            broker.host, broker.port, identifier="offline-consumer", clean_session=False
        ) as subscriber:
            received = await _receive(subscriber, len(sent))

    assert received == sent


def test_stop_is_idempotent_and_frees_the_port(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path)
    broker.start()
    assert broker.is_running()

    broker.stop()
    broker.stop()

    assert not broker.is_running()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((broker.host, broker.port), timeout=1.0).close()


async def test_kill_loses_what_was_queued_since_the_last_clean_stop(tmp_path: Path) -> None:
    with Mosquitto(tmp_path) as broker:
        await _subscribe_persistently(broker, "offline-consumer", "queue/test")
        broker.restart()  # the session is now on disk
        await _publish(broker, "queue/test", [b"lost-1", b"lost-2"])

        broker.kill()
        assert not broker.is_running()
        broker.start()

        await _publish(broker, "queue/test", [b"after-crash"])
        async with aiomqtt.Client(
            broker.host, broker.port, identifier="offline-consumer", clean_session=False
        ) as subscriber:
            received = await _receive(subscriber, 1)

    assert received == [b"after-crash"]


def test_start_failure_reports_the_log(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path, extra_config="no_such_option true")

    with pytest.raises(RuntimeError, match="no_such_option"):
        broker.start()

    assert not broker.is_running()
