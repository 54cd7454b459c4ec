"""The mqtt5 codec facts Mqtt5Connection relies on, and its pieces that need no broker."""

from __future__ import annotations

import aiomqtt
import mqtt5
import pytest

from gateway.mqtt.v5_connection import (
    _PUBACK,
    Delivery,
    Mqtt5Connection,
    MqttConnectError,
    MqttProtocolError,
    _frame_size,
    _Violation,
    disconnect_reason,
)
from gateway.mqtt.v311_client import ConnectionSettings

SETTINGS = ConnectionSettings(host="127.0.0.1", port=1, client_id="unit")


def _publish(packet_id: int, topic: str = "a/b", payload: bytes = b"hello") -> bytes:
    return mqtt5.PublishPacket(
        topic, payload, qos=mqtt5.QoS.AT_LEAST_ONCE, packet_id=packet_id
    ).write()


def test_read_raises_index_error_on_every_incomplete_prefix() -> None:
    data = _publish(7)
    for size in range(len(data)):
        with pytest.raises(IndexError):
            mqtt5.read(memoryview(data)[:size])
    packet, size = mqtt5.read(memoryview(data + b"\xd0\x00"))
    assert size == len(data)
    assert isinstance(packet, mqtt5.PublishPacket)
    assert (packet.topic, packet.payload, packet.packet_id) == ("a/b", b"hello", 7)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\x00",  # packet type 0
        b"\xff\xff\xff\xff\xff",  # remaining length over four bytes
        b"\x30\x03\x00\x01a",  # PUBLISH without its properties
        b"\x30\x06\x00\x05ab\x00\x00",  # topic longer than the packet
    ],
)
def test_read_raises_value_error_on_garbage(garbage: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the codec's messages are not an API
        mqtt5.read(memoryview(garbage))


def test_a_topic_that_is_not_utf8_panics_the_codec_with_a_base_exception() -> None:
    """Why the read loop catches BaseException around ``read`` (and only there)."""
    with pytest.raises(BaseException, match="pointer is null") as caught:
        mqtt5.read(memoryview(b"\x30\x05\x00\x01\xff\x00\x00"))
    assert not isinstance(caught.value, Exception)
    assert type(caught.value).__name__ == "PanicException"
    # The codec still works afterwards.
    packet, _ = mqtt5.read(memoryview(b"\xd0\x00"))
    assert isinstance(packet, mqtt5.PingRespPacket)


def test_reason_codes_are_not_ints_at_run_time() -> None:
    """Why the connection compares ``int(code)``."""
    packet, _ = mqtt5.read(memoryview(b"\x90\x04\x00\x01\x00\x80"))
    assert isinstance(packet, mqtt5.SubAckPacket)
    (code,) = packet.reason_codes
    with pytest.raises(TypeError):
        _ = code >= 0x80  # the stub says IntEnum; at run time it is not
    assert int(code) == 0x80


def test_an_empty_suback_decodes() -> None:
    packet, _ = mqtt5.read(memoryview(b"\x90\x03\x00\x01\x00"))
    assert isinstance(packet, mqtt5.SubAckPacket)
    assert packet.reason_codes == []


@pytest.mark.parametrize("packet_id", [1, 255, 256, 65535])
def test_our_puback_bytes_are_the_codecs(packet_id: int) -> None:
    ours = _PUBACK.pack(0x40, 2, packet_id)
    assert ours == mqtt5.PubAckPacket(packet_id).write()
    packet, size = mqtt5.read(memoryview(ours))
    assert isinstance(packet, mqtt5.PubAckPacket)
    assert (packet.packet_id, int(packet.reason_code), size) == (packet_id, 0, 4)


def test_frame_size_from_the_fixed_header() -> None:
    small = _publish(1)
    assert _frame_size(memoryview(small), 0, len(small)) == len(small)
    big = _publish(1, payload=b"x" * 100_000)
    view = memoryview(big)
    assert _frame_size(view, 0, len(big)) == len(big)
    assert _frame_size(view, 0, 4) == len(big)  # header (1 + 3 length bytes) complete
    for end in (1, 2, 3):
        assert _frame_size(view, 0, end) is None  # header itself incomplete
    with pytest.raises(_Violation):
        _frame_size(memoryview(b"\x30\xff\xff\xff\xff\x01"), 0, 6)


def test_delivery_is_small_and_slotted() -> None:
    delivery = Delivery("t", b"p", 1, 5, False, None)
    assert not hasattr(delivery, "__dict__")
    assert (delivery.topic, delivery.payload, delivery.qos, delivery.packet_id) == ("t", b"p", 1, 5)
    assert "5 bytes" not in repr(delivery)
    assert "<1 bytes>" in repr(delivery)


def test_ack_before_connecting_or_from_elsewhere_is_refused() -> None:
    conn = Mqtt5Connection(SETTINGS)
    other = Mqtt5Connection(SETTINGS)
    assert not conn.ack(Delivery("t", b"p", 1, 5, False, conn))  # not open
    assert not conn.ack(Delivery("t", b"p", 1, 5, False, other))
    assert conn.ack(Delivery("t", b"p", 0, None, False, other))  # QoS 0 needs no PUBACK


def test_settings_it_refuses() -> None:
    with pytest.raises(ValueError, match="MQTT 5"):
        Mqtt5Connection(ConnectionSettings(host="h", port=1, client_id="c", protocol="3.1.1"))
    with pytest.raises(ValueError, match="receive_maximum"):
        Mqtt5Connection(ConnectionSettings(host="h", port=1, client_id="c", receive_maximum=0))


def test_errors_are_aiomqtt_errors_carrying_their_reason_code() -> None:
    error = MqttConnectError("refused", 134)
    assert isinstance(error, aiomqtt.MqttError)
    assert error.reason_code == 134
    assert isinstance(MqttProtocolError("x", 130), aiomqtt.MqttError)


def test_disconnect_reason_by_number() -> None:
    assert disconnect_reason(4) == mqtt5.DisconnectReasonCode.DISCONNECT_WITH_WILL_MESSAGE
    with pytest.raises(ValueError, match="no DISCONNECT reason code 3"):
        disconnect_reason(3)


async def test_messages_before_connecting_raises() -> None:
    conn = Mqtt5Connection(SETTINGS)
    with pytest.raises(aiomqtt.MqttError):
        await anext(conn.messages)
