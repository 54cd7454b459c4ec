"""A broker that sends a QoS 1 message again on the same connection while the gateway has not
acknowledged it yet (EMQX's `mqtt.retry_interval`, 30 s by default and not to be turned off,
does so on MQTT 5 too, with DUP set; NATS's `ack_wait` on 3.1.1). The gateway acknowledges
only after the commit, so any commit slower than that (PostgreSQL away, a lock, a failover)
meets the resend. On MQTT 5 the connection was ended as a protocol error ("packet id 1 reused
before our PUBACK"): every 30 s of a database outage the node dropped its connection, its
reading and its subscriptions' listening, reconnected and took the whole window again. Now
the resend is dropped as the copy it is, as on 3.1.1, and the message stored once.

The resend is forced on the wire: a proxy between the daemon and mosquitto writes the
broker's PUBLISH to the daemon a second time, DUP set, while the message waits on a lock."""

from __future__ import annotations

import aiomqtt
import asyncpg
import pytest

from protocol import Topics
from tests.support.daemon import count_rows, make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
TOPIC = TOPICS.telemetry("held").encode()


def _first_packet(chunk: bytes) -> bytes:
    """The first MQTT packet of ``chunk`` (whole: the tests' packets are small)."""
    length = shift = 0
    index = 1
    while True:
        byte = chunk[index]
        index += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return chunk[: index + length]
        shift += 7


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_broker_resending_an_unacknowledged_message_keeps_the_connection(
    db_dsn: str, mosquitto: Mosquitto, protocol: str
) -> None:
    sent: list[bytes] = []

    def from_server(chunk: bytes) -> bool:
        if chunk[0] >> 4 == 3 and TOPIC in chunk[:64]:
            sent.append(_first_packet(chunk))
        return True

    blocker = await asyncpg.connect(db_dsn)
    try:
        async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
            proxy.from_server = from_server
            config = make_config(dsn=db_dsn, mqtt_port=proxy.port, protocol=protocol)
            async with running_daemon(config) as daemon:
                session = daemon.session
                assert session is not None
                client = session.client
                assert client is not None
                connections = session.connections
                # Every insert now waits: the message stays unacknowledged.
                await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
                async with aiomqtt.Client("127.0.0.1", mosquitto.port) as device:
                    payload = b'{"ts": 1767225600000, "metrics": {"t": 1}}'
                    await device.publish(TOPICS.telemetry("held"), payload, qos=1)
                await wait_until(lambda: bool(sent), timeout=30, message="the broker sent it")
                await wait_until(
                    lambda: client.unacked == 1, timeout=30, message="read, unacknowledged"
                )
                packet = sent[0]
                assert packet[0] & 0x06 == 0x02, "a QoS 1 PUBLISH"
                assert proxy.to_clients(bytes([packet[0] | 0x08]) + packet[1:]) == 1
                # A PINGREQ's answer comes behind the resend: read, it has been handled.
                await client.hear_again(10.0)
                assert client.is_open, (
                    "the broker's resend of a message the gateway had not acknowledged yet"
                    f" ended the connection: {client.error}"
                )
                await blocker.execute("ROLLBACK")
                await wait_until(
                    lambda: client.unacked == 0, timeout=30, message="stored and acknowledged"
                )
                assert session.client is client
                assert session.connections == connections
            assert await count_rows(db_dsn) == 1
    finally:
        await blocker.close()
