"""The hand-written MQTT 3.1.1 codec of Mqtt311Connection: packets out, and the read loop fed
bytes directly (whole, split at every byte, coalesced) on one end of a socket pair, whose other
end reads what the connection writes. What a broker makes of the packets we write is the broker
contract suite's (mosquitto and amqtt)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from gateway.mqtt.v5_connection import (
    _CONNECTING,
    Delivery,
    Mqtt5Connection,
    MqttConnectError,
    MqttProtocolError,
    _Wire,
)
from gateway.mqtt.v311_client import SETTLE_FILTER, ConnectionSettings
from gateway.mqtt.v311_connection import (
    CONNACK_REFUSALS,
    DISCONNECT_PACKET,
    Mqtt311Connection,
    connect_packet,
    publish_packet,
    remaining_length,
    subscribe_packet,
    unsubscribe_packet,
)
from sim import wire

SETTINGS = ConnectionSettings(
    host="127.0.0.1", port=1, client_id="unit", protocol="3.1.1", keepalive_s=0
)
CONNACK_OK = b"\x20\x02\x00\x00"


def _settings(**overrides: Any) -> ConnectionSettings:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 1,
        "client_id": "unit",
        "protocol": "3.1.1",
        "keepalive_s": 0,
    }
    values.update(overrides)
    return ConnectionSettings(**values)


Make = Callable[..., Awaitable[Mqtt311Connection]]


@pytest.fixture
async def sockets() -> AsyncIterator[list[socket.socket]]:
    """The far ends of the socket pairs made by a test (the broker's side), closed after it."""
    ends: list[socket.socket] = []
    yield ends
    for end in ends:
        end.close()


@pytest.fixture
async def connecting(sockets: list[socket.socket]) -> AsyncIterator[Make]:
    """A connection as __aenter__ leaves it after sending CONNECT, on a real transport."""
    made: list[Mqtt311Connection] = []

    async def make(settings: ConnectionSettings = SETTINGS) -> Mqtt311Connection:
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        sockets.append(theirs)
        conn = Mqtt311Connection(settings)
        loop = asyncio.get_running_loop()
        conn._loop = loop
        conn._state = _CONNECTING
        conn._connack = loop.create_future()
        conn._lost = loop.create_future()
        await loop.create_connection(lambda: _Wire(conn), sock=ours)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.abort()
        await conn.close()


@pytest.fixture
async def open_(connecting: Make) -> Make:
    async def make(settings: ConnectionSettings = SETTINGS) -> Mqtt311Connection:
        conn = await connecting(settings)
        conn._on_data(CONNACK_OK)
        assert conn.is_open
        return conn

    return make


async def _written(end: socket.socket, size: int) -> bytes:
    """What the connection wrote to the far end: ``size`` bytes, within a deadline."""
    loop = asyncio.get_running_loop()
    data = b""
    async with asyncio.timeout(5):
        while len(data) < size:
            data += await loop.sock_recv(end, size - len(data))
    return data


def _fields(delivery: Delivery) -> tuple[str, bytes, int, int | None, bool]:
    return (delivery.topic, delivery.payload, delivery.qos, delivery.packet_id, delivery.retain)


# --------------------------------------------------------------------------- packets out


def test_remaining_length_is_mqtts_variable_length_integer() -> None:
    cases = {0: b"\x00", 127: b"\x7f", 128: b"\x80\x01", 16_383: b"\xff\x7f"}
    cases |= {16_384: b"\x80\x80\x01", 268_435_455: b"\xff\xff\xff\x7f"}
    for length, encoded in cases.items():
        assert remaining_length(length) == encoded
    with pytest.raises(ValueError, match="out of range"):
        remaining_length(268_435_456)


def test_connect_packet_fields() -> None:
    # The spec's layout: protocol name, level 4, flags, keep-alive, then the payload in order.
    bare = connect_packet("id", clean_session=True, keepalive_s=60)
    assert bare == b"\x10\x0e\x00\x04MQTT\x04\x02\x00\x3c\x00\x02id"
    assert bare == wire.connect_packet("id", 60)  # the simulator's, written independently
    full = connect_packet(
        "id",
        clean_session=False,
        keepalive_s=30,
        username="u",
        password="pw",
        will_topic="w/t",
        will_payload=b"off",
    )
    body = b"\x00\x04MQTT\x04" + bytes([0x80 | 0x40 | 0x20 | 0x08 | 0x04]) + b"\x00\x1e"
    body += b"\x00\x02id" + b"\x00\x03w/t" + b"\x00\x03off" + b"\x00\x01u" + b"\x00\x02pw"
    assert full == b"\x10" + remaining_length(len(body)) + body


def test_publish_subscribe_unsubscribe_disconnect_packets() -> None:
    assert publish_packet("a/b", b"hi", qos=1, packet_id=7) == wire.publish_packet("a/b", b"hi", 7)
    assert publish_packet("a", b"", qos=0, retain=True) == b"\x31\x03\x00\x01a"
    assert subscribe_packet(5, "a/+", 1) == b"\x82\x08\x00\x05\x00\x03a/+\x01"
    assert unsubscribe_packet(6, "a/#") == b"\xa2\x07\x00\x06\x00\x03a/#"
    assert DISCONNECT_PACKET == wire.DISCONNECT
    large = publish_packet("t", b"x" * 200, qos=1, packet_id=1)
    assert large[1:3] == remaining_length(3 + 2 + 200)


@pytest.mark.parametrize(
    ("topic", "qos", "packet_id"),
    [("", 0, None), ("a/+", 0, None), ("a/#", 1, 1), ("a\x00b", 0, None), ("a", 1, None)],
)
def test_publish_packets_we_refuse_to_write(topic: str, qos: int, packet_id: int | None) -> None:
    with pytest.raises(ValueError, match=r"invalid topic|packet id"):
        publish_packet(topic, b"", qos=qos, packet_id=packet_id)


def test_settings_it_refuses_and_what_it_is() -> None:
    with pytest.raises(ValueError, match=r"Mqtt311Connection speaks MQTT 3\.1\.1 only"):
        Mqtt311Connection(_settings(protocol="5"))
    conn = Mqtt311Connection(SETTINGS)
    assert isinstance(conn, Mqtt5Connection)  # the same machinery, and the same interface
    assert conn.capabilities.protocol == "3.1.1"
    assert conn.learned_max_packet_size is None


# --------------------------------------------------------------------------- packets in


async def test_connack_opens_and_says_whether_a_session_was_present(connecting: Make) -> None:
    conn = await connecting()
    conn._on_data(b"\x20\x02\x01\x00")
    assert conn.is_open
    assert conn.session_present
    assert conn.capabilities.fields() == {"protocol": "3.1.1"}


@pytest.mark.parametrize("code", sorted(CONNACK_REFUSALS))
async def test_connack_refusals_become_connect_errors_with_mqtt5_codes(
    code: int, connecting: Make
) -> None:
    conn = await connecting()
    conn._on_data(bytes([0x20, 0x02, 0x00, code]))
    assert conn._connack is not None
    outcome = conn._connack.result()
    assert isinstance(outcome, MqttConnectError)
    assert outcome.reason_code == CONNACK_REFUSALS[code][0]
    assert CONNACK_REFUSALS[code][1] in str(outcome)
    assert not conn.is_open


async def test_publishes_round_trip_whole_split_at_every_byte_and_coalesced(open_: Make) -> None:
    packets = [
        publish_packet("a/b", b"hello", qos=1, packet_id=1),
        publish_packet("c", b"", qos=0),
        publish_packet("d/é", b"x" * 300, qos=1, retain=True, packet_id=65535),
    ]
    expected = [
        ("a/b", b"hello", 1, 1, False),
        ("c", b"", 0, None, False),
        ("d/é", b"x" * 300, 1, 65535, True),
    ]
    stream = b"".join(packets)
    coalesced = await open_()
    coalesced._on_data(stream)
    assert [_fields(d) for d in coalesced._deliveries] == expected
    for cut in range(1, len(stream)):
        conn = await open_()
        conn._on_data(stream[:cut])
        conn._on_data(stream[cut:])
        assert [_fields(d) for d in conn._deliveries] == expected, cut
    bytewise = await open_()
    for index in range(len(stream)):
        bytewise._on_data(stream[index : index + 1])
    assert [_fields(d) for d in bytewise._deliveries] == expected
    assert type(bytewise._deliveries[2].payload) is bytes
    assert bytewise.buffered_bytes == sum(len(t) + len(p) for t, p, *_ in expected)


async def test_control_packets_answer_their_requests(open_: Make) -> None:
    conn = await open_()
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future[Any]] = []
    for packet_id in (1, 2):
        waiting.append(conn._subscribes.setdefault(packet_id, loop.create_future()))
    waiting.append(conn._unsubscribes.setdefault(3, loop.create_future()))
    waiting.append(conn._publishes.setdefault(4, loop.create_future()))
    conn._ping_outstanding = True
    conn._on_data(
        b"\x90\x03\x00\x01\x01" + b"\x90\x03\x00\x02\x80" + b"\xb0\x02\x00\x03"
        b"\x40\x02\x00\x04" + b"\xd0\x00"
    )
    assert conn.is_open
    # Granted QoS 1; refused (0x80); UNSUBACK and PUBACK carry no code in 3.1.1: 0.
    assert [f.result() for f in waiting] == [[1], [0x80], [0], 0]
    assert (conn._subscribes, conn._unsubscribes, conn._publishes) == ({}, {}, {})
    assert not conn._ping_outstanding
    assert conn.pingresps_received == 1


async def test_a_resent_publish_still_unacknowledged_is_not_delivered_twice(open_: Make) -> None:
    conn = await open_()
    packet = publish_packet("a", b"p", qos=1, packet_id=9)
    conn._on_data(packet + packet)
    assert len(conn._deliveries) == 1
    assert conn.duplicates_dropped == 1
    assert conn.ack(conn._deliveries[0])
    assert conn.unsettled_acks == 1
    conn._on_data(packet)  # acknowledged: the id is the broker's again, for a new message
    assert len(conn._deliveries) == 2


async def test_ack_only_once_and_only_here(open_: Make, sockets: list[socket.socket]) -> None:
    conn = await open_()
    other = await open_()
    conn._on_data(publish_packet("a", b"p", qos=1, packet_id=1))
    delivery = conn._deliveries[0]
    assert not other.ack(delivery)
    assert conn.ack(delivery)
    assert not conn.ack(delivery)
    assert conn.unsettled_acks == 1
    assert await _written(sockets[0], 4) == b"\x40\x02\x00\x01"  # the one PUBACK


async def test_reading_pauses_at_the_bound_and_the_rest_of_the_chunk_waits(open_: Make) -> None:
    conn = await open_(_settings(buffer_high=2))
    stream = b"".join(publish_packet("a", b"%d" % n, qos=0) for n in range(5))
    conn._on_data(stream)
    assert [d.payload for d in conn._deliveries] == [b"0", b"1"]
    assert conn._held
    assert conn.reading_paused
    taken: list[bytes] = []
    while len(taken) < 5:  # each take resumes, and parsing stops at the bound again
        taken += [d.payload for d in await conn.take(10)]
        assert len(conn._deliveries) <= 2
    assert taken == [b"%d" % n for n in range(5)]
    assert not conn.reading_paused
    assert conn.pauses >= 2


MALFORMED = [
    pytest.param(b"\x30\xff\xff\xff\xff\x01", "remaining length over four bytes", id="length"),
    pytest.param(b"\x30\x01\x00", "shorter than its topic length", id="publish-1-byte"),
    pytest.param(b"\x30\x04\x00\x05ab", "shorter than its topic", id="topic-past-end"),
    pytest.param(b"\x32\x03\x00\x01a", "shorter than its topic", id="qos1-no-packet-id"),
    pytest.param(b"\x32\x05\x00\x01a\x00\x00", "packet id 0", id="packet-id-0"),
    pytest.param(b"\x30\x02\x00\x00", "empty topic", id="empty-topic"),
    pytest.param(b"\x30\x05\x00\x01\xff\x00\x00", "not UTF-8", id="topic-not-utf8"),
    pytest.param(b"\x36\x05\x00\x01a\x00\x01", "QoS 3", id="qos3"),
    pytest.param(b"\x42\x02\x00\x01", "reserved flags", id="puback-flags"),
    pytest.param(b"\x40\x03\x00\x01\x00", "PUBACK of 3 bytes", id="puback-long"),
    pytest.param(b"\x90\x04\x00\x01\x01\x01", "SUBACK of 4 bytes", id="suback-two-codes"),
    pytest.param(b"\x90\x03\x00\x01\x03", "SUBACK return code", id="suback-code-3"),
    pytest.param(b"\xb0\x03\x00\x01\x00", "UNSUBACK of 3 bytes", id="unsuback-long"),
    pytest.param(b"\xd0\x01\x00", "PINGRESP with a body", id="pingresp-body"),
]
UNEXPECTED = [
    pytest.param(b"\x34\x05\x00\x01a\x00\x01", "QoS 2", id="qos2"),
    pytest.param(CONNACK_OK, "second CONNACK", id="second-connack"),
    pytest.param(b"\x40\x02\x00\x63", "unknown packet id 99", id="puback-unknown"),
    pytest.param(b"\x90\x03\x00\x07\x01", "SUBACK for unknown", id="suback-unknown"),
    pytest.param(b"\xb0\x02\x00\x07", "UNSUBACK for unknown", id="unsuback-unknown"),
    pytest.param(b"\xc0\x00", "packet type 12", id="pingreq-to-a-client"),
    pytest.param(b"\x00\x00", "packet type 0", id="type-0"),
    pytest.param(b"\xe0\x00", "packet type 14", id="disconnect-from-server"),
]


@pytest.mark.parametrize(("garbage", "detail"), [*MALFORMED, *UNEXPECTED])
async def test_malformed_or_unexpected_input_ends_the_connection(
    garbage: bytes, detail: str, open_: Make
) -> None:
    conn = await open_()
    conn._on_data(publish_packet("ok", b"before", qos=0) + garbage)
    assert not conn.is_open
    error = conn._error
    assert isinstance(error, MqttProtocolError)
    assert detail in str(error)
    assert error.reason_code in (0x81, 0x82, 0x9B)  # malformed, protocol error, QoS 2
    with pytest.raises(MqttProtocolError):
        await anext(conn.messages)  # what was buffered went with the connection


async def test_malformed_split_across_chunks_ends_the_connection_too(open_: Make) -> None:
    conn = await open_()
    conn._on_data(b"\x30\x05\x00")
    assert conn.is_open  # incomplete yet
    conn._on_data(b"\x01\xff\x00\x00")
    assert isinstance(conn._error, MqttProtocolError)


async def test_publish_before_connack_is_a_protocol_error(connecting: Make) -> None:
    conn = await connecting()
    conn._on_data(publish_packet("a", b"p", qos=0))
    assert isinstance(conn._error, MqttProtocolError)
    assert conn._connack is not None
    assert isinstance(conn._connack.result(), MqttProtocolError)


async def test_a_malformed_connack_fails_the_connect(connecting: Make) -> None:
    conn = await connecting()
    conn._on_data(b"\x20\x02\x02\x00")  # reserved acknowledge flags
    assert conn._connack is not None
    assert isinstance(conn._connack.result(), MqttProtocolError)


# --------------------------------------------------------------------------- how it ends


async def _until_eof(end: socket.socket) -> bytes:
    """Everything the connection writes until it closes its side."""
    loop = asyncio.get_running_loop()
    data = b""
    async with asyncio.timeout(5):
        while chunk := await loop.sock_recv(end, 65536):
            data += chunk
    return data


async def test_a_protocol_error_closes_without_disconnect_so_the_will_is_published(
    open_: Make, sockets: list[socket.socket]
) -> None:
    conn = await open_()
    conn._on_data(b"\xc0\x00")  # PINGREQ: no packet a client receives
    assert isinstance(conn._error, MqttProtocolError)
    assert await _until_eof(sockets[0]) == b""


async def test_closing_settles_the_acks_with_an_unsubscribe_round_trip_then_disconnects(
    open_: Make, sockets: list[socket.socket]
) -> None:
    conn = await open_()
    far = sockets[0]
    conn._on_data(publish_packet("a", b"p", qos=1, packet_id=3))
    assert conn.ack(conn._deliveries[0])
    closing = asyncio.create_task(conn.__aexit__(None, None, None))
    settle = unsubscribe_packet(1, SETTLE_FILTER)
    assert await _written(far, 4 + len(settle)) == b"\x40\x02\x00\x03" + settle
    assert not closing.done()  # no DISCONNECT before the broker answered
    await asyncio.get_running_loop().sock_sendall(far, b"\xb0\x02\x00\x01")  # UNSUBACK
    assert await _until_eof(far) == DISCONNECT_PACKET
    await closing
    assert conn.unsettled_acks == 0


async def test_closing_without_acks_disconnects_at_once(
    open_: Make, sockets: list[socket.socket]
) -> None:
    conn = await open_()
    await conn.__aexit__(None, None, None)
    assert await _until_eof(sockets[0]) == DISCONNECT_PACKET
