"""One MQTT 3.1.1 broker connection: ``Mqtt5Connection``'s machinery with a hand-written codec.

Why. The 3.1.1 path went through paho/aiomqtt (``gateway.mqtt.v311_client.AckingClient``), about
four times slower per message than MQTT 5 on the ``mqtt5`` codec (issue 27). Everything that
made MQTT 5 fast is protocol-independent and lives in ``Mqtt5Connection`` (one parse loop per
chunk, deliveries in a deque handed out in batches, PUBACKs of a loop iteration in one write,
bounded buffering with transport pause/resume, keep-alive, in-flight publish slots). This class
reuses all of it and replaces only the codec hooks: CONNECT, the read loop (``_parse``),
SUBSCRIBE, UNSUBSCRIBE, PUBLISH and DISCONNECT.

Why hand-written. No maintained fast 3.1.1 codec exists for Python: ``mqtt5`` speaks MQTT 5
only; paho's and amqtt's parsers are tied to their own clients and sockets (paho's is the
ceiling we are leaving; amqtt's reads through an ``asyncio.StreamReader`` per packet);
``hbmqtt`` is amqtt's unmaintained ancestor; ``gmqtt`` and ``asyncio-mqtt`` are clients with
their own automatic acknowledgement, not codecs. MQTT 3.1.1's client side is small: the packets
below are all a client sends or receives at QoS 0/1. ``sim/wire.py`` (the benchmark's load
generator) writes CONNECT and PUBLISH too; it is not shared, since ``sim`` sits below ``gateway``
in the import layers and the load generator stays independent of what it measures: the unit
tests check that both write the same bytes.

What it speaks (OASIS MQTT 3.1.1):

* CONNECT with client id, clean session (``not persistent_session``), keep-alive, user name and
  password, and a Will (QoS 1, retained) when ``will_topic`` is set.
* CONNACK: return codes 1-5 are refusals, raised as ``MqttConnectError`` with the MQTT 5 reason
  code each corresponds to (1 0x84 unsupported protocol version, 2 0x85 client id not valid,
  3 0x88 server unavailable, 4 0x86 bad user name or password, 5 0x87 not authorized), so the
  session's "refused for good" handling is the same on both protocols; session present.
* PUBLISH QoS 0 and 1 both ways (QoS 2 from the broker is a protocol error: we subscribe at
  QoS 1 at most), PUBACK, SUBSCRIBE/SUBACK (0x80 refuses: ``MqttSubscribeError``, a
  ``SubscriptionRefusedError``), UNSUBSCRIBE/UNSUBACK, PINGREQ/PINGRESP, DISCONNECT.

What differs from MQTT 5, on purpose:

* 3.1.1 has no reason codes in PUBACK or UNSUBACK: ``publish`` returns None (as
  ``AckingClient`` did: it cannot say whether anyone was subscribed, docs/behaviour.md §5),
  ``unsubscribe`` returns 0.
* No Receive Maximum: the window of unacknowledged deliveries is the broker's configuration
  (mosquitto's ``max_inflight_messages``); memory is bounded by the read buffer's bounds alone.
  A QoS 1 PUBLISH whose packet id is still unacknowledged can only be a resend of the same
  message (the broker may not reuse an id before our PUBACK), so it is dropped, not delivered
  twice.
* Only a normal close sends DISCONNECT. On a protocol error, or a close asking for the Will,
  the connection is closed without one: in 3.1.1 that is what makes the broker publish the
  Will, and a DISCONNECT has no reason code to say anything else.
* Closing settles the acknowledgements first, as ``AckingClient`` did: mosquitto reads a
  client's packets a few at a time and a new connection with the same client id takes the
  session over with the rest unread, so before DISCONNECT one UNSUBSCRIBE of a filter never
  subscribed is answered, within ``timeout_s``, only after every PUBACK sent before it.

Malformed input (a bad remaining length, a packet shorter or longer than its fields, reserved
flag bits set, a packet type a client never receives, a topic that is not UTF-8 or is empty,
packet id 0) ends the connection as a protocol error (``MqttProtocolError``, logged as
``broker_protocol_error``); nothing raises out of the event loop's callbacks.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from types import TracebackType
from typing import Final

import structlog
from mqtt5 import DisconnectReasonCode, QoS

from gateway.mqtt.capabilities import BrokerCapabilities
from gateway.mqtt.v5_connection import (
    _CLOSED,
    _CONNECTING,
    _OPEN,
    Delivery,
    Mqtt5Connection,
    Mqtt5Error,
    MqttConnectError,
    _Violation,
)
from gateway.mqtt.v311_client import SETTLE_FILTER, ConnectionSettings
from gateway.support.broker_link import Ready
from gateway.support.publish_refusal import PacketTooLarge

log = structlog.get_logger(__name__)

__all__ = [
    "CONNACK_REFUSALS",
    "Mqtt311Connection",
    "connect_packet",
    "publish_packet",
    "remaining_length",
]

# Packet types (the fixed header's high nibble).
CONNECT: Final = 1
CONNACK: Final = 2
PUBLISH: Final = 3
PUBACK: Final = 4
SUBSCRIBE: Final = 8
SUBACK: Final = 9
UNSUBSCRIBE: Final = 10
UNSUBACK: Final = 11
PINGRESP: Final = 13
DISCONNECT_PACKET: Final = b"\xe0\x00"
_MAX_REMAINING: Final = 268_435_455
_U16: Final = struct.Struct(">H")

# CONNACK return codes 1-5, as the MQTT 5 reason codes that mean the same (see the docstring),
# with their 3.1.1 names.
CONNACK_REFUSALS: Final = {
    1: (0x84, "unacceptable protocol version"),
    2: (0x85, "identifier rejected"),
    3: (0x88, "server unavailable"),
    4: (0x86, "bad user name or password"),
    5: (0x87, "not authorized"),
}
_MALFORMED: Final = DisconnectReasonCode.MALFORMED_PACKET
_PROTOCOL: Final = DisconnectReasonCode.PROTOCOL_ERROR


def remaining_length(length: int) -> bytes:
    """MQTT's variable-length integer (1 to 4 bytes, 7 bits each, low first)."""
    if not 0 <= length <= _MAX_REMAINING:
        raise ValueError(f"remaining length out of range: {length}")
    out = bytearray()
    while True:
        byte, length = length % 128, length // 128
        out.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(out)


def _string(raw: bytes) -> bytes:
    if len(raw) > 0xFFFF:
        raise ValueError("an MQTT string is 65,535 bytes at most")
    return _U16.pack(len(raw)) + raw


def _topic(topic: str, *, filter_: bool) -> bytes:
    raw = topic.encode()
    if not raw or "\x00" in topic:
        raise ValueError(f"invalid topic {topic!r}: empty or with a NUL character")
    if not filter_ and ("+" in topic or "#" in topic):
        raise ValueError(f"invalid topic {topic!r}: wildcards are for filters only")
    return _string(raw)


def connect_packet(
    client_id: str,
    *,
    clean_session: bool,
    keepalive_s: int,
    username: str = "",
    password: str = "",
    will_topic: str = "",
    will_payload: bytes = b"",
) -> bytes:
    """CONNECT, protocol level 4; the Will, when given, is QoS 1 and retained."""
    flags = 0x02 if clean_session else 0
    payload = _string(client_id.encode())
    if will_topic:
        flags |= 0x04 | 0x08 | 0x20  # Will, Will QoS 1, Will retain
        payload += _topic(will_topic, filter_=False) + _string(will_payload)
    if username:
        flags |= 0x80
        payload += _string(username.encode())
    if password:
        flags |= 0x40
        payload += _string(password.encode())
    body = b"\x00\x04MQTT\x04" + bytes([flags]) + _U16.pack(keepalive_s) + payload
    return bytes([CONNECT << 4]) + remaining_length(len(body)) + body


def publish_packet(
    topic: str, payload: bytes, *, qos: int, retain: bool = False, packet_id: int | None = None
) -> bytes:
    """PUBLISH at QoS 0 (no packet id) or 1."""
    head = _topic(topic, filter_=False)
    if qos:
        if not packet_id:
            raise ValueError("a QoS 1 PUBLISH needs a packet id")
        head += _U16.pack(packet_id)
    first = (PUBLISH << 4) | (qos << 1) | (1 if retain else 0)
    return bytes([first]) + remaining_length(len(head) + len(payload)) + head + payload


def subscribe_packet(packet_id: int, topic: str, qos: int) -> bytes:
    body = _U16.pack(packet_id) + _topic(topic, filter_=True) + bytes([qos])
    return bytes([(SUBSCRIBE << 4) | 0x02]) + remaining_length(len(body)) + body


def unsubscribe_packet(packet_id: int, topic: str) -> bytes:
    body = _U16.pack(packet_id) + _topic(topic, filter_=True)
    return bytes([(UNSUBSCRIBE << 4) | 0x02]) + remaining_length(len(body)) + body


class Mqtt311Connection(Mqtt5Connection):
    """One MQTT 3.1.1 connection (single use): ``async with Mqtt311Connection(settings)``.

    The interface is ``Mqtt5Connection``'s (``messages``, ``take``, ``ack``, ``subscribe``,
    ``unsubscribe``, ``publish``, ``stop_intake``, ``close``, ``abort``, ``capabilities``,
    ``learned_max_packet_size``, ``on_pause``); its errors are the same classes."""

    PROTOCOL = "3.1.1"
    _FOREIGN_CONNACK = None  # a 3.1.1 CONNACK is ours

    def __init__(
        self,
        settings: ConnectionSettings,
        *,
        buffer_high_bytes: int = 64 * 2**20,
        on_pause: Callable[[str], None] | None = None,
        max_packet_size: int | None = None,
    ) -> None:
        super().__init__(
            settings,
            buffer_high_bytes=buffer_high_bytes,
            strict_receive_maximum=False,  # 3.1.1 has no Receive Maximum: never checked
            on_pause=on_pause,
            max_packet_size=max_packet_size,
        )
        # PUBACKs written that the broker has not been seen to handle (see settle_acks).
        self.unsettled_acks = 0

    # ------------------------------------------------------------------ codec hooks, out

    def _connect_packet(self) -> bytes:
        s = self.settings
        return connect_packet(
            s.client_id,
            clean_session=not s.persistent_session,
            keepalive_s=s.keepalive_s,
            username=s.username,
            password=s.password,
            will_topic=s.will_topic,
            will_payload=s.will_payload,
        )

    def _subscribe_packet(self, packet_id: int, topic: str, qos: int) -> bytes:
        return subscribe_packet(packet_id, topic, qos)

    def _unsubscribe_packet(self, packet_id: int, topic: str) -> bytes:
        return unsubscribe_packet(packet_id, topic)

    def _suback_reason(self, code: int) -> str:
        return "Failure" if code == 0x80 else "unknown return code"

    def _disconnect_packet(self, reason: DisconnectReasonCode) -> bytes:
        # 3.1.1's DISCONNECT says "normal, discard the Will" and nothing else: for any other
        # reason the connection just closes, which makes the broker publish the Will.
        return DISCONNECT_PACKET if reason == DisconnectReasonCode.NORMAL_DISCONNECTION else b""

    def _publish_bytes(
        self, topic: str, payload: bytes, qos: QoS, retain: bool, packet_id: int | None
    ) -> bytes:
        data = publish_packet(
            topic,
            payload,
            qos=0 if qos == QoS.AT_MOST_ONCE else 1,
            retain=retain,
            packet_id=packet_id,
        )
        limit = self.packet_limit
        if limit is not None and len(data) > limit[0]:
            raise PacketTooLarge(topic, len(data), *limit)
        return data

    # ------------------------------------------------------------------ interface differences

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        wait_s: float | None = None,
        ready: Ready | None = None,
    ) -> int | None:
        """As ``Mqtt5Connection.publish``, returning None: a 3.1.1 PUBACK carries no reason
        code, so it cannot say whether anyone was subscribed. A packet over
        ``max_packet_size`` raises ``PacketTooLarge`` unsent: a 3.1.1 broker cannot say why it
        refuses one (it closes the connection)."""
        await super().publish(topic, payload, qos=qos, retain=retain, wait_s=wait_s, ready=ready)
        return None

    def ack(self, delivery: Delivery) -> bool:
        acked = super().ack(delivery)
        if acked and delivery.qos:
            self.unsettled_acks += 1
        return acked

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.settle_acks()
        await self.close()

    async def settle_acks(self) -> bool:
        """Wait, up to ``timeout_s``, until the broker handled the PUBACKs given so far (one
        UNSUBSCRIBE round trip, answered only after them). Nothing more is taken meanwhile:
        what arrives stays unacknowledged, for the next session. True when settled (or none
        was given); False, logged, when the connection is gone or the broker does not answer
        in time."""
        given, self.unsettled_acks = self.unsettled_acks, 0
        if given == 0:
            return True
        if self._state != _OPEN:
            log.info("mqtt_acks_unsettled", acks=given, reason="connection lost")
            return False
        self.stop_intake()  # and read on: the answer must get through a paused reader
        try:
            await self.unsubscribe(SETTLE_FILTER, wait_s=self.settings.timeout_s)
        except Mqtt5Error as exc:
            log.warning("mqtt_acks_unsettled", acks=given, reason=str(exc))
            return False
        return True

    # ------------------------------------------------------------------ codec hook, in

    def _parse(self, buffer: bytes | bytearray) -> tuple[int, int]:  # noqa: PLR0912, PLR0915 - the hot loop, inlined
        """Every complete packet of ``buffer``: the deliveries added and their bytes; the
        incomplete tail is kept for the next chunk. Raises _Violation for what must end the
        connection. PUBLISH is decoded inline (no call per message)."""
        if type(buffer) is not bytes:
            # One copy of the chunk, so that each payload below is sliced (copied) once.
            buffer = bytes(buffer)
        end = len(buffer)
        pos = 0
        deliveries = self._deliveries
        unacked = self._unacked
        intake = not self._intake_stopped
        high, high_bytes = self.settings.buffer_high, self.buffer_high_bytes
        held_bytes = self._buffered_bytes
        added = added_bytes = 0
        while pos < end:
            # The fixed header: type and flags, then 1-4 bytes of remaining length.
            first = buffer[pos]
            index = pos + 1
            length = shift = 0
            while True:
                if index >= end:
                    length = -1  # the header itself is incomplete
                    break
                byte = buffer[index]
                index += 1
                length |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    break
                shift += 7
                if shift == 28:
                    raise _Violation(_MALFORMED, "remaining length over four bytes")
            packet_end = index + length
            if length < 0 or packet_end > end:
                self._rest = bytearray(memoryview(buffer)[pos:])
                self._need = 0 if length < 0 else packet_end - pos
                break
            kind = first >> 4
            if kind == PUBLISH:
                if self._state != _OPEN:
                    raise _Violation(_PROTOCOL, "PUBLISH before CONNACK")
                qos = (first >> 1) & 0x03
                if length < 2:
                    raise _Violation(_MALFORMED, "PUBLISH shorter than its topic length")
                topic_end = index + 2 + ((buffer[index] << 8) | buffer[index + 1])
                packet_id: int | None = None
                start = topic_end
                if qos:
                    if qos != 1:
                        raise _Violation(
                            DisconnectReasonCode.QOS_NOT_SUPPORTED if qos == 2 else _MALFORMED,
                            f"QoS {qos} PUBLISH received",
                        )
                    start += 2
                    if start > packet_end:
                        raise _Violation(_MALFORMED, "PUBLISH shorter than its topic")
                    packet_id = (buffer[topic_end] << 8) | buffer[topic_end + 1]
                    if not packet_id:
                        raise _Violation(_MALFORMED, "PUBLISH with packet id 0")
                elif start > packet_end:
                    raise _Violation(_MALFORMED, "PUBLISH shorter than its topic")
                if topic_end == index + 2:
                    raise _Violation(_MALFORMED, "PUBLISH with an empty topic")
                try:
                    topic = buffer[index + 2 : topic_end].decode()
                except UnicodeDecodeError:
                    raise _Violation(_MALFORMED, "PUBLISH topic is not UTF-8") from None
                pos = packet_end
                if packet_id is not None:
                    if packet_id in unacked:
                        # A resend of the message we hold (the id is ours until our PUBACK).
                        self.duplicates_dropped += 1
                        continue
                    unacked.add(packet_id)
                if intake:
                    payload = buffer[start:packet_end]
                    deliveries.append(
                        Delivery(
                            topic,
                            payload,
                            0 if packet_id is None else 1,
                            packet_id,
                            bool(first & 0x01),
                            self,
                        )
                    )
                    added += 1
                    added_bytes += len(payload) + len(topic)
                    if len(deliveries) >= high or held_bytes + added_bytes >= high_bytes:
                        if pos < end:  # the rest of the chunk waits, unparsed, for the resume
                            self._rest = bytearray(memoryview(buffer)[pos:])
                            self._held = True
                        break
                continue
            body = buffer[index:packet_end]
            pos = packet_end
            self._control(first, body)
            if self._state == _CLOSED:
                break
        return added, added_bytes

    def _control(self, first: int, body: bytes | bytearray) -> None:
        """One packet other than PUBLISH, complete."""
        kind = first >> 4
        if first & 0x0F:
            raise _Violation(_MALFORMED, f"packet type {kind} with reserved flags set")
        if kind == PUBACK:
            if len(body) != 2:
                raise _Violation(_MALFORMED, f"PUBACK of {len(body)} bytes")
            self._puback((body[0] << 8) | body[1], 0)
        elif kind == PINGRESP:
            if body:
                raise _Violation(_MALFORMED, "PINGRESP with a body")
            self.pingresps_received += 1
            self._ping_outstanding = False
        elif kind == SUBACK:
            if len(body) != 3:
                raise _Violation(_MALFORMED, f"SUBACK of {len(body)} bytes for one filter")
            code = body[2]
            if code not in (0, 1, 2, 0x80):
                raise _Violation(_MALFORMED, f"SUBACK return code {code:#04x}")
            self._answered(self._subscribes, "SUBACK", (body[0] << 8) | body[1], [code])
        elif kind == UNSUBACK:
            if len(body) != 2:
                raise _Violation(_MALFORMED, f"UNSUBACK of {len(body)} bytes")
            self._answered(self._unsubscribes, "UNSUBACK", (body[0] << 8) | body[1], [0])
        elif kind == CONNACK:
            self._connack_311(body)
        else:
            raise _Violation(_PROTOCOL, f"packet type {kind} is not one a client receives")

    def _connack_311(self, body: bytes | bytearray) -> None:
        if self._state != _CONNECTING:
            raise _Violation(_PROTOCOL, "second CONNACK")
        if len(body) != 2 or body[0] & 0xFE:
            raise _Violation(_MALFORMED, f"CONNACK {bytes(body).hex()}")
        code = body[1]
        connack = self._connack
        assert connack is not None
        if code != 0:
            mapped, name = CONNACK_REFUSALS.get(code, (0x80, "unknown return code"))
            self._terminate(
                MqttConnectError(f"connection refused: {name} (return code {code})", mapped)
            )
            return
        self._state = _OPEN
        self.session_present = bool(body[0] & 0x01)
        # 3.1.1's CONNACK says nothing of what the broker can do: unknown, as before.
        self.capabilities = BrokerCapabilities(protocol="3.1.1")
        if self.keep_alive > 0:
            loop = self._loop
            assert loop is not None
            self._timer = loop.call_at(loop.time() + self.keep_alive, self._tick)
        if not connack.done():
            connack.set_result(None)
