"""One MQTT 5 broker connection on the ``mqtt5`` codec: QoS 1 acknowledged only when we say so.

Why hand-written. The gateway's invariant (a QoS 1 message is PUBACKed only after the
transaction storing it committed, and only on the connection that delivered it) needs a client
that never acknowledges on its own, lets reading be paused, and parses fast: paho's parser is
the throughput ceiling of ``gateway.mqtt.v311_client.AckingClient`` (about 8k msg/s). ``mqtt5`` is a
sans-I/O MQTT 5 packet codec written in Rust (by the aiomqtt maintainer); no installable
asyncio client is built on it (aiomqtt 3.0.0a1 pins ``mqtt5~=0.5.0``, which has no wheel for
this platform), so this module drives the codec itself with an ``asyncio.Protocol``.

How it reads. Every ``data_received`` chunk is parsed in one loop over a memoryview: each
complete packet is decoded where it lies and only the incomplete tail is kept (copied once)
for the next chunk; a packet larger than one chunk is collected until its announced length
has arrived, then parsed once. Inbound QoS 0/1 PUBLISHes become small slotted ``Delivery``
objects in a deque that ``messages`` hands out; the consumer is woken once per chunk. The
PUBACKs of one burst of ``ack()`` calls are written together by one callback scheduled on the
loop. Nothing per message creates a task, a future or a log line.

Facts about ``mqtt5`` 0.8.0 this relies on (checked by experiment, see the unit tests):

* ``read(view)`` returns ``(packet, nbytes)`` for the first complete packet in ``view`` and
  raises ``IndexError("Not enough bytes")`` when the packet is incomplete.
* Malformed input raises ``ValueError`` (bad packet type, bad remaining length, missing
  properties), except a topic that is not UTF-8, which makes the Rust side panic:
  ``pyo3_runtime.PanicException``, a ``BaseException`` (not ``Exception``) subclass, after
  printing the panic to stderr. Both end the connection as a malformed packet.
* A SUBACK's reason-code list may be empty; it is checked against what we asked.
* Its reason codes are not ``int`` at run time (no ``<`` with an int, unhashable): they are
  compared through ``int(code)``.

Deliberately not done: QoS 2 in either direction (subscriptions ask ``max_qos`` 1; a QoS 2
PUBLISH from the broker is a protocol error), topic aliases (we announce a maximum of 0),
enhanced authentication (AUTH packets), subscription identifiers, user properties, message
expiry, request/response properties, reconnection and resending after a reconnect (the caller
reconnects: ``gateway.mqtt.session``; a connection object is single use and cheap).

The broker's limits. A publish larger than the broker's Maximum Packet Size (from CONNACK) or
than ``max_packet_size`` (ours: configured, or learned) is refused before sending with
``PacketTooLarge``. Every reason code MQTT 5 allows in a PUBACK is understood
(``gateway.support.publish_refusal``): a refusal raises ``MqttPublishError``, a
``PublishRefused`` saying whether it is final, and is logged once per code and connection
(``broker_refused_publish``); the connection stays up. mosquitto answers 0x95 (Packet too
large) in a PUBACK, which MQTT 5 does not list and the codec refuses to decode: a PUBACK (or a
DISCONNECT) the codec cannot read is read here instead, by its fixed layout, rather than ending
the connection as malformed. A DISCONNECT of 0x95 names no packet: the largest publishes then
waiting for their PUBACK are the culprits (the broker answers in order, so the one it refused
is among them); they fail with ``PacketTooLarge`` and ``learned_max_packet_size`` says the
bound the next connection must keep below, so the same message never drops a connection twice.

Flow control, inbound. We announce ``receive_maximum``: by default a broker sending more
unacknowledged QoS 1 publishes than that is disconnected with RECEIVE_MAX_EXCEEDED, as MQTT 5
says. mosquitto 2.0.11 does exceed it once PUBACKs flow (it keeps our window while nothing is
acknowledged; measured: thousands over a window of 50, and the daemon's own fault and ingest
tests reconnect in a loop when strict), so ``strict_receive_maximum=False`` tolerates it: the
overrun is logged once per connection (``broker_receive_maximum_exceeded``) and counted, and
memory stays bounded by the read buffer's bounds. A QoS 1 PUBLISH with DUP set whose packet id
we have not acknowledged yet is the broker sending it again on the same connection (EMQX's
``mqtt.retry_interval``): dropped, as on 3.1.1, since the copy we hold is acknowledged once
stored; without DUP it is a protocol error. Deliveries read from the socket and not yet
taken by the consumer are bounded in count (``settings.buffer_high``) and in bytes
(``buffer_high_bytes``): parsing stops at either bound (the rest of the chunk waits, unparsed),
reading the transport pauses, and it resumes once both are at half or below, so TCP flow
control holds the rest in the broker. Outbound, QoS 1 publishes wait for a slot under the
broker's Receive Maximum from CONNACK.

Liveness. A PINGREQ goes out when nothing was sent for the keep-alive interval (the server's,
when CONNACK carries one) or nothing was received for that long; when nothing at all arrives
for 1.5 times the interval the connection is dead and is aborted. While reading is paused on
purpose, silence is ours, and the dead-connection clock restarts on resume. Until then a
stalled link looks like a quiet one: ``heard_at`` says when anything last came, and
``hear_again`` asks the broker (a PINGREQ) and waits briefly for an answer, so that a caller
judging what it heard (the inactivity monitor, through the session) does not take a stall for
listening.

Errors are subclasses of ``aiomqtt.MqttError``, so a caller's existing ``except
aiomqtt.MqttError`` reconnect path handles both clients. Anything malformed or unexpected from
the broker is logged (``broker_protocol_error``) and ends the connection: it never raises out
of the event loop's callbacks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import socket
import struct
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Final, Self, cast

import aiomqtt
import mqtt5
import structlog
from mqtt5 import (
    ConnAckPacket,
    DisconnectPacket,
    DisconnectReasonCode,
    PingRespPacket,
    PubAckPacket,
    PublishPacket,
    QoS,
    SubAckPacket,
    UnsubAckPacket,
)

from gateway.mqtt.capabilities import BrokerCapabilities
from gateway.mqtt.v311_client import ConnectionSettings, SubscriptionRefusedError
from gateway.support.broker_link import PublishInDoubt, PublishWithdrawn, Ready
from gateway.support.publish_refusal import (
    PACKET_TOO_LARGE,
    PacketTooLarge,
    PublishRefused,
    disconnect_code,
    publish_code,
)

log = structlog.get_logger(__name__)

__all__ = [
    "Delivery",
    "Mqtt5Connection",
    "Mqtt5Error",
    "MqttConnectError",
    "MqttConnectionLostError",
    "MqttKeepAliveError",
    "MqttNoConnAckError",
    "MqttProtocolError",
    "MqttPublishError",
    "MqttSubscribeError",
    "MqttTimeoutError",
    "MqttUnsubscribeError",
]

_PUBACK: Final = struct.Struct(">BBH")  # fixed header 0x40, remaining length 2, packet id
_PUBACK_HEADER: Final = 0x40
_PINGREQ: Final = mqtt5.PingReqPacket().write()
_MAX_PACKET_ID: Final = 65535
_QOS0: Final = QoS.AT_MOST_ONCE
_QOS1: Final = QoS.AT_LEAST_ONCE
_FAILURE: Final = 0x80  # reason codes from here up are failures (MQTT 5, 2.4)
_PUBACK_TYPE: Final = 4
_DISCONNECT_TYPE: Final = 14
_DEAD_AFTER: Final = 1.5  # keep-alive intervals without any packet received

_NEW, _CONNECTING, _OPEN, _CLOSED = range(4)


def _disconnect_codes() -> dict[int, DisconnectReasonCode]:
    codes = {}
    for name in dir(DisconnectReasonCode):
        if name.isupper():
            code = getattr(DisconnectReasonCode, name)
            codes[int(code)] = code
    return codes


_DISCONNECT_CODES: Final = _disconnect_codes()


class Mqtt5Error(aiomqtt.MqttError):
    """Base of this module's errors (an ``aiomqtt.MqttError``, for existing handlers)."""

    def __init__(self, message: str, reason_code: int | None = None) -> None:
        super().__init__(message)
        self.reason_code = reason_code


class MqttConnectError(Mqtt5Error):
    """Connecting failed: refused by CONNACK (``reason_code`` set), unreachable, TLS, timeout."""


class MqttNoConnAckError(MqttConnectError):
    """The TCP connection opened and no CONNACK came: a broker that speaks MQTT 3.1.1 only may
    wait forever for the rest of a CONNECT it cannot parse (amqtt does)."""


# What a refusal of our protocol version looks like: MQTT 5's reason code, which an MQTT 3.1.1
# broker's CONNACK (two bytes, in the older format) is mapped to as well.
UNSUPPORTED_PROTOCOL_VERSION: Final = 0x84


class MqttConnectionLostError(Mqtt5Error):
    """The connection ended; ``reason_code`` is the server's DISCONNECT reason when it sent one."""


class MqttProtocolError(MqttConnectionLostError):
    """The broker sent something malformed or unexpected; ``reason_code`` is what we told it."""


class MqttPublishInDoubtError(MqttConnectionLostError, PublishInDoubt):
    """The connection ended after a QoS 1 PUBLISH was written and before its PUBACK came: the
    broker may have it. ``reason_code`` is the connection's (its DISCONNECT's, when sent)."""


class MqttKeepAliveError(MqttConnectionLostError):
    """Nothing arrived from the broker for 1.5 keep-alive intervals."""


class MqttTimeoutError(Mqtt5Error):
    """A subscribe or publish got no answer within its wait."""


class MqttSubscribeError(Mqtt5Error, SubscriptionRefusedError):
    """The SUBACK refused the subscription (reason code 0x80 or more, or a QoS below ours)."""

    def __init__(self, topic: str, reason_code: int, reason: str) -> None:
        # Both bases' attributes, set here: their __init__s take different arguments.
        aiomqtt.MqttError.__init__(
            self, f"subscribe to {topic!r} refused: {reason} ({reason_code})"
        )
        self.reason_code = reason_code
        self.topic = topic
        self.reason = reason


class MqttUnsubscribeError(Mqtt5Error):
    """The UNSUBACK refused to remove a subscription (reason code 0x80 or more)."""


class MqttPublishError(Mqtt5Error, PublishRefused):
    """The PUBACK refused the publish (reason code 0x80 or more); ``final`` as
    ``gateway.support.publish_refusal`` says for its code."""

    def __init__(self, topic: str, reason_code: int) -> None:
        known = publish_code(reason_code)
        PublishRefused.__init__(
            self,
            f"publish to {topic!r} refused: {known.name} ({reason_code:#04x}): {known.meaning}",
            reason_code=reason_code,
            final=known.final,
        )
        self.topic = topic


class _Violation(Exception):
    """Raised inside the read loop: end the connection with this DISCONNECT reason."""

    def __init__(self, code: DisconnectReasonCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class Delivery:
    """One PUBLISH received from the broker; acknowledge QoS 1 with ``Mqtt5Connection.ack``."""

    __slots__ = ("_origin", "packet_id", "payload", "qos", "retain", "topic")

    def __init__(  # noqa: PLR0917 - built positionally, once per message, in the read loop
        self,
        topic: str,
        payload: bytes,
        qos: int,
        packet_id: int | None,
        retain: bool,
        origin: Mqtt5Connection | None,
    ) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.packet_id = packet_id
        self.retain = retain
        # The connection that may acknowledge it; None once acknowledged.
        self._origin = origin

    def __repr__(self) -> str:
        return (
            f"Delivery(topic={self.topic!r}, payload=<{len(self.payload)} bytes>, qos={self.qos},"
            f" packet_id={self.packet_id}, retain={self.retain})"
        )


class _Wire(asyncio.Protocol):
    """The transport's callbacks, handed to the connection (one call per chunk, not message)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Mqtt5Connection) -> None:
        self._conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conn._on_made(cast("asyncio.Transport", transport))

    def data_received(self, data: bytes) -> None:
        self._conn._on_data(data)

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn._on_lost(exc)


class _Messages:
    """``Mqtt5Connection.messages``: deliveries in arrival order, until the connection ends."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Mqtt5Connection) -> None:
        self._conn = conn

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Delivery:
        return await self._conn._next_delivery()


class Mqtt5Connection:
    """One MQTT 5 connection (single use): ``async with Mqtt5Connection(settings) as conn``.

    Everything but the codec is protocol-independent (reading over a memoryview, bounded
    buffering, batched PUBACKs, keep-alive, in-flight slots): ``gateway.mqtt.v311_connection``
    reuses it for MQTT 3.1.1 by overriding the hooks marked "codec hook" below."""

    # Codec hooks: the protocol this class speaks, and a CONNACK of another protocol that
    # means the broker cannot speak ours.
    PROTOCOL: str = "5"
    _FOREIGN_CONNACK: bytes | None = b"\x20\x02"  # MQTT 3.1.1's format: remaining length 2

    def __init__(  # noqa: PLR0915 - one assignment per piece of connection state
        self,
        settings: ConnectionSettings,
        *,
        buffer_high_bytes: int = 64 * 2**20,
        strict_receive_maximum: bool = True,
        on_pause: Callable[[str], None] | None = None,
        max_packet_size: int | None = None,
    ) -> None:
        if settings.protocol != self.PROTOCOL:
            raise ValueError(f"{type(self).__name__} speaks MQTT {self.PROTOCOL} only")
        if not 1 <= settings.receive_maximum <= _MAX_PACKET_ID:
            raise ValueError("receive_maximum must be within 1..65535")
        self.settings = settings
        self.buffer_high_bytes = buffer_high_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: asyncio.Transport | None = None
        self._state = _NEW
        self._error: Mqtt5Error | None = None
        # The CONNACK (None from a codec that keeps no packet object), or why there is none.
        self._connack: asyncio.Future[ConnAckPacket | Mqtt5Error | None] | None = None
        self._lost: asyncio.Future[None] | None = None
        # Done once the connection has ended, whatever ended it (see ``ended``).
        self._ended: asyncio.Future[None] | None = None
        self._abort_handle: asyncio.TimerHandle | None = None
        # Reading: the incomplete tail of the last chunk, and the size it must reach.
        self._rest = bytearray()
        self._need = 0
        # Inbound deliveries.
        self._deliveries: collections.deque[Delivery] = collections.deque()
        self._buffered_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._unacked: set[int] = set()
        self._receive_max = settings.receive_maximum
        self.strict_receive_maximum = strict_receive_maximum
        self.receive_maximum_overruns = 0
        # QoS 1 PUBLISHes the broker sent again while we held them unacknowledged: dropped.
        self.duplicates_dropped = 0
        self._intake_stopped = False
        self._paused = False
        self._held = False  # _rest holds complete packets, parsed on resume
        self.pauses = 0
        self.on_pause = on_pause  # told which bound ("messages" or "bytes") paused reading
        # Writing: bytes queued for one write at the end of this loop iteration.
        self._out = bytearray()
        self._flush_handle: asyncio.Handle | None = None
        # Outbound requests.
        self._publishes: dict[int, asyncio.Future[int]] = {}
        self._subscribes: dict[int, asyncio.Future[list[int]]] = {}
        self._unsubscribes: dict[int, asyncio.Future[list[int]]] = {}
        self._next_id = 0
        self._send_max = _MAX_PACKET_ID
        self._slots_free = _MAX_PACKET_ID
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._max_qos = 1
        self._retain_available = True
        # Ours (configured or learned; None: none) and the broker's (CONNACK; None: unsaid).
        self.max_packet_size = max_packet_size
        self._max_packet_size: int | None = None
        self.learned_max_packet_size: int | None = None
        self._publish_sizes: dict[int, tuple[int, str]] = {}  # packet id: size, topic
        self._refusals_logged: set[int] = set()
        self.publish_refusals = 0
        # Liveness.
        self.keep_alive = settings.keepalive_s
        self._last_read = 0.0
        self._last_write = 0.0
        # When bytes last came from the broker (``_last_read`` also restarts on a resume, when
        # nothing came), and who waits for the next (``hear_again``).
        self._heard_at = 0.0
        self._hear_waiters: list[asyncio.Future[None]] = []
        self._ping_outstanding = False
        self._timer: asyncio.TimerHandle | None = None
        self.pings_sent = 0
        self.pingresps_received = 0
        self.session_present = False
        self.capabilities = BrokerCapabilities(protocol=self.PROTOCOL)
        self._messages = _Messages(self)

    # ------------------------------------------------------------------ public state

    @property
    def is_open(self) -> bool:
        return self._state == _OPEN

    @property
    def ended(self) -> asyncio.Future[None]:
        """Done once the connection has ended (lost, timed out, closed); ``error`` says why.
        What waits on a reader of ``take`` waits on this too: a reader blocked elsewhere (its
        queue full) would learn of the end only at its next ``take``."""
        if self._ended is None:
            raise RuntimeError("not connected yet")
        return self._ended

    @property
    def error(self) -> Mqtt5Error | None:
        """Why the connection ended (None while it has not)."""
        return self._error

    @property
    def messages(self) -> _Messages:
        """Deliveries as they arrive; ends with an ``Mqtt5Error`` when the connection does."""
        return self._messages

    @property
    def buffered(self) -> int:
        """Deliveries read from the socket and not yet taken from ``messages``."""
        return len(self._deliveries)

    @property
    def buffered_bytes(self) -> int:
        """Their topic and payload bytes."""
        return self._buffered_bytes

    @property
    def reading_paused(self) -> bool:
        return self._paused

    @property
    def heard_at(self) -> float:
        """When anything last came from the broker (the loop's clock; 0: nothing yet), or it
        closed the connection: what it sent before then has been read, what it sent since is
        not known to have been. A link
        that stalls without closing (a NAT or firewall dropping its state) stops this clock
        long before the keep-alive ends the connection, 1.5 intervals later."""
        return self._heard_at

    async def hear_again(self, wait_s: float) -> float:
        """Ask the broker for an answer (a PINGREQ) and wait up to ``wait_s`` for anything
        from it; returns ``heard_at`` then. On a live link that is now, give or take a round
        trip (on an idle one, ``heard_at`` alone may be a keep-alive interval old); on a
        stalled one it stays when the link stalled. Nothing is asked while reading is paused
        on purpose (the answer could not be read) or the connection is not open."""
        if self._state != _OPEN or self._paused:
            return self._heard_at
        loop = cast("asyncio.AbstractEventLoop", self._loop)
        waiter: asyncio.Future[None] = loop.create_future()
        self._hear_waiters.append(waiter)
        self.pings_sent += 1
        self._send_now(_PINGREQ)
        try:
            async with asyncio.timeout(wait_s):
                await waiter
        except TimeoutError:
            pass
        finally:
            if waiter in self._hear_waiters:
                self._hear_waiters.remove(waiter)
        return self._heard_at

    @property
    def unacked(self) -> int:
        """Inbound QoS 1 publishes not yet acknowledged (what our Receive Maximum counts)."""
        return len(self._unacked)

    @property
    def inflight(self) -> int:
        """Our QoS 1 publishes waiting for their PUBACK."""
        return len(self._publishes)

    @property
    def server_receive_maximum(self) -> int:
        return self._send_max

    @property
    def server_max_packet_size(self) -> int | None:
        """The broker's Maximum Packet Size from CONNACK (None: it said nothing)."""
        return self._max_packet_size

    @property
    def packet_limit(self) -> tuple[int, str] | None:
        """The bound a publish must keep to, and where it comes from (None: no bound)."""
        ours, theirs = self.max_packet_size, self._max_packet_size
        if theirs is not None and (ours is None or theirs <= ours):
            return theirs, "the broker's CONNACK"
        if ours is not None:
            return ours, "[mqtt] max_packet_size, or learned from the broker's 0x95"
        return None

    # ------------------------------------------------------------------ connect / close

    async def __aenter__(self) -> Self:
        if self._state != _NEW:
            raise RuntimeError(f"an {type(self).__name__} connects once; make a new one")
        self._state = _CONNECTING
        s = self.settings
        loop = self._loop = asyncio.get_running_loop()
        connack = self._connack = loop.create_future()
        self._lost = loop.create_future()
        self._ended = loop.create_future()
        ssl_context = s.tls.context() if s.tls is not None else None
        connected = False
        try:
            async with asyncio.timeout(s.timeout_s):
                await loop.create_connection(
                    lambda: _Wire(self),
                    s.host,
                    s.port,
                    ssl=ssl_context,
                    server_hostname=s.host if ssl_context is not None else None,
                )
                connected = True
                self._send_now(self._connect_packet())
                outcome = await connack
        except TimeoutError:
            # Only a broker that took the connection and said nothing is "no CONNACK" (maybe a
            # 3.1.1-only one: the session asks); an address that drops packets is unreachable.
            error: MqttConnectError = (
                MqttNoConnAckError(f"no CONNACK from {s.host}:{s.port} within {s.timeout_s}s")
                if connected
                else MqttConnectError(
                    f"cannot connect to {s.host}:{s.port}: no answer within {s.timeout_s}s"
                )
            )
            self._terminate(error, abort=True)
            raise error from None
        except OSError as exc:  # refused, unreachable, TLS verification
            error = MqttConnectError(f"cannot connect to {s.host}:{s.port}: {exc}")
            self._terminate(error, abort=True)
            raise error from exc
        except BaseException:
            self._terminate(MqttConnectionLostError("connect abandoned"), abort=True)
            raise
        if isinstance(outcome, Mqtt5Error):
            if isinstance(outcome, MqttConnectError):
                raise outcome
            raise MqttConnectError(str(outcome), outcome.reason_code) from outcome
        return self

    def _connect_packet(self) -> bytes:  # codec hook
        s = self.settings
        will = None
        if s.will_topic:
            will = mqtt5.Will(s.will_topic, payload=s.will_payload, qos=_QOS1, retain=True)
        return mqtt5.ConnectPacket(
            s.client_id,
            username=s.username or None,
            password=s.password.encode() if s.password else None,
            clean_start=not s.persistent_session,
            will=will,
            keep_alive=s.keepalive_s,
            session_expiry_interval=s.session_expiry_s if s.persistent_session else 0,
            receive_max=s.receive_maximum,
            topic_alias_max=0,
        ).write()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(
        self, reason_code: DisconnectReasonCode = DisconnectReasonCode.NORMAL_DISCONNECTION
    ) -> None:
        """Send DISCONNECT (with ``reason_code``; DISCONNECT_WITH_WILL_MESSAGE publishes the
        Will) after anything queued, close, and wait for the transport to finish closing."""
        if self._state == _OPEN:
            self._terminate(
                MqttConnectionLostError("connection closed by the client"), disconnect=reason_code
            )
        lost = self._lost
        if lost is not None and not lost.done():
            try:
                async with asyncio.timeout(self.settings.timeout_s):
                    await asyncio.shield(lost)
            except TimeoutError:
                self.abort()

    def abort(self) -> None:
        """Drop the connection at once, without DISCONNECT: the broker publishes the Will."""
        self._terminate(MqttConnectionLostError("connection aborted by the client"), abort=True)
        transport = self._transport
        if transport is not None:
            transport.abort()

    # ------------------------------------------------------------------ inbound

    async def _next_delivery(self) -> Delivery:
        deliveries = self._deliveries
        while True:
            if deliveries:
                delivery = deliveries.popleft()
                self._buffered_bytes -= len(delivery.payload) + len(delivery.topic)
                if self._paused:
                    self._maybe_resume()
                return delivery
            if self._state != _OPEN:
                raise self._error or MqttConnectionLostError("not connected")
            if self._waiter is not None:
                raise RuntimeError("messages has one consumer at a time")
            assert self._loop is not None
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def take(self, limit: int) -> list[Delivery]:
        """Up to ``limit`` deliveries, waiting only while there is none (the batch form of
        ``messages``: no await per message). Raises like ``messages`` once the connection is
        lost and nothing is left."""
        taken = [await self._next_delivery()]
        deliveries = self._deliveries
        count = min(limit - 1, len(deliveries))
        if count > 0:
            more = [deliveries.popleft() for _ in range(count)]
            self._buffered_bytes -= sum(len(d.payload) + len(d.topic) for d in more)
            taken += more
            if self._paused:
                self._maybe_resume()
        return taken

    def ack(self, delivery: Delivery) -> bool:
        """Queue the PUBACK of a delivery of this connection (written with the others of this
        loop iteration); False when the connection is closed, the delivery came from another
        connection, or it was acknowledged already. QoS 0 needs none: True. A connection lost
        before the write loses the PUBACK: the broker redelivers, never to a wrong ack."""
        if delivery.qos == 0:
            return True
        if delivery._origin is not self or self._state != _OPEN:
            return False
        packet_id = cast("int", delivery.packet_id)
        try:
            self._unacked.remove(packet_id)
        except KeyError:
            return False
        delivery._origin = None
        self._out += _PUBACK.pack(_PUBACK_HEADER, 2, packet_id)
        if self._flush_handle is None:
            assert self._loop is not None
            self._flush_handle = self._loop.call_soon(self._flush)
        return True

    def stop_intake(self) -> None:
        """Shutdown: drop what is buffered and whatever arrives from now on (never acknowledged,
        so the broker keeps it), and read again so replies to our own requests arrive."""
        self._intake_stopped = True
        self._deliveries.clear()
        self._buffered_bytes = 0
        if self._paused:
            self._maybe_resume()

    # ------------------------------------------------------------------ outbound

    async def subscribe(self, topic: str, qos: int = 1, *, wait_s: float | None = None) -> None:
        """Subscribe and wait for the SUBACK (``wait_s`` None: ``settings.timeout_s``;
        ``math.inf``: as long as the connection lives). A refusal (reason code 0x80 or more)
        raises MqttSubscribeError, and so does a grant below the QoS asked: a QoS 1 stream
        silently downgraded to QoS 0 would lose messages. An invalid filter raises ValueError
        (the codec checks it) before anything is sent."""
        if qos not in (0, 1):
            raise ValueError("QoS 2 is not supported: subscribe with qos 0 or 1")
        self._check_open()
        loop = cast("asyncio.AbstractEventLoop", self._loop)
        packet_id = self._allocate_id()
        data = self._subscribe_packet(packet_id, topic, qos)
        future: asyncio.Future[list[int]] = loop.create_future()
        self._subscribes[packet_id] = future
        self._send(data)
        # The entry stays until the SUBACK arrives, even if we stop waiting: the id is in use.
        (code,) = await self._wait(future, wait_s, f"SUBACK for {topic!r}")
        if code >= _FAILURE:
            raise MqttSubscribeError(topic, code, self._suback_reason(code))
        if code < qos:
            raise MqttSubscribeError(topic, code, f"granted QoS {code}, asked {qos}")

    async def unsubscribe(self, topic: str, *, wait_s: float | None = None) -> int:
        """Remove a subscription and wait for the UNSUBACK; returns its reason code (0x11
        NO_SUBSCRIPTION_EXISTED is success too: nothing to remove). A refusal (0x80 or more)
        raises MqttUnsubscribeError."""
        self._check_open()
        loop = cast("asyncio.AbstractEventLoop", self._loop)
        packet_id = self._allocate_id()
        data = self._unsubscribe_packet(packet_id, topic)
        future: asyncio.Future[list[int]] = loop.create_future()
        self._unsubscribes[packet_id] = future
        self._send(data)
        (code,) = await self._wait(future, wait_s, f"UNSUBACK for {topic!r}")
        if code >= _FAILURE:
            name = _reason_name(mqtt5.UnsubAckReasonCode, code)
            raise MqttUnsubscribeError(f"unsubscribe from {topic!r} refused: {name} ({code})", code)
        return code

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
        """QoS 1: returns the PUBACK's reason code once it arrives (0x10 NO_MATCHING_SUBSCRIBERS
        is success too: the broker took it, nobody was subscribed; a code of 0x80 or more raises
        MqttPublishError); waits for a slot under the broker's Receive Maximum first. A slot
        that came after a wait is not used before ``ready`` says the message is still wanted:
        False passes the slot on and raises :class:`PublishWithdrawn`, nothing sent (a slot
        free at once asks nothing). QoS 0: returns None once queued for writing (there is no
        answer)."""
        if qos not in (0, 1):
            raise ValueError("QoS 2 is not supported: publish with qos 0 or 1")
        self._check_open()
        if qos > self._max_qos:
            raise ValueError(f"the broker accepts QoS {self._max_qos} at most")
        if retain and not self._retain_available:
            raise ValueError("the broker does not support retained messages")
        if qos == 0:
            self._send(self._publish_bytes(topic, payload, _QOS0, retain, None))
            return None
        wait = self.settings.timeout_s if wait_s is None else wait_s
        try:
            async with asyncio.timeout(None if math.isinf(wait) else wait):
                waited = await self._acquire_slot()
                if waited and ready is not None:
                    try:
                        wanted = await ready()
                    except BaseException:
                        self._release_slot()
                        raise
                    if not wanted:
                        self._release_slot()
                        raise PublishWithdrawn(topic)
                    self._check_open()
                packet_id = self._allocate_id()
                loop = cast("asyncio.AbstractEventLoop", self._loop)
                future: asyncio.Future[int] = loop.create_future()
                self._publishes[packet_id] = future
                try:
                    data = self._publish_bytes(topic, payload, _QOS1, retain, packet_id)
                    self._send(data)
                except BaseException:
                    del self._publishes[packet_id]
                    self._release_slot()
                    raise
                self._publish_sizes[packet_id] = (len(data), topic)
                # Cancelled or timed out, the entry (and its slot) stays until the PUBACK.
                try:
                    code = await future
                except MqttConnectionLostError as exc:
                    # Written, and no PUBACK before the end: the broker may have it.
                    raise MqttPublishInDoubtError(
                        f"no PUBACK for {topic!r} before the connection ended: {exc}",
                        exc.reason_code,
                    ) from exc
        except TimeoutError:
            raise MqttTimeoutError(f"no PUBACK for {topic!r} within {wait}s") from None
        if code >= _FAILURE:
            self._refused(code)
            raise MqttPublishError(topic, code)
        return code

    # Codec hooks: the request packets, and the name of a SUBACK's failure code.

    def _subscribe_packet(self, packet_id: int, topic: str, qos: int) -> bytes:
        topic_filter = mqtt5.TopicFilter(
            topic, max_qos=_QOS1 if qos else _QOS0, retain_as_published=False
        )
        return mqtt5.SubscribePacket(packet_id, [topic_filter]).write()

    def _unsubscribe_packet(self, packet_id: int, topic: str) -> bytes:
        return mqtt5.UnsubscribePacket(packet_id, [topic]).write()

    def _suback_reason(self, code: int) -> str:
        return _reason_name(mqtt5.SubAckReasonCode, code)

    def _disconnect_packet(self, reason: DisconnectReasonCode) -> bytes:
        return DisconnectPacket(reason_code=reason).write()

    def _refused(self, code: int) -> None:
        """Log a PUBACK refusal once per code and connection; count them all."""
        self.publish_refusals += 1
        if code in self._refusals_logged:
            return
        self._refusals_logged.add(code)
        known = publish_code(code)
        log.warning(
            "broker_refused_publish",
            reason_code=f"{code:#04x}",
            reason=known.name,
            meaning=known.meaning,
            final=known.final,
            note="logged once per code and connection; the connection stays up",
            **self._where(),
        )

    def _publish_bytes(  # codec hook
        self, topic: str, payload: bytes, qos: QoS, retain: bool, packet_id: int | None
    ) -> bytes:
        data = PublishPacket(topic, payload, qos=qos, retain=retain, packet_id=packet_id).write()
        limit = self.packet_limit
        if limit is not None and len(data) > limit[0]:
            raise PacketTooLarge(topic, len(data), *limit)
        return data

    async def _wait(
        self, future: asyncio.Future[list[int]], wait_s: float | None, what: str
    ) -> list[int]:
        wait = self.settings.timeout_s if wait_s is None else wait_s
        try:
            async with asyncio.timeout(None if math.isinf(wait) else wait):
                return await future
        except TimeoutError:
            raise MqttTimeoutError(f"no {what} within {wait}s") from None

    def _check_open(self) -> None:
        if self._state != _OPEN:
            raise self._error or MqttConnectionLostError("not connected")

    def _allocate_id(self) -> int:
        packet_id = self._next_id
        publishes, subscribes = self._publishes, self._subscribes
        for _ in range(_MAX_PACKET_ID):
            packet_id = packet_id % _MAX_PACKET_ID + 1
            if (
                packet_id not in publishes
                and packet_id not in subscribes
                and packet_id not in self._unsubscribes
            ):
                self._next_id = packet_id
                return packet_id
        raise Mqtt5Error("every packet id is in use")

    async def _acquire_slot(self) -> bool:
        """A slot under the broker's Receive Maximum; True when it had to be waited for."""
        if self._slots_free > 0 and not self._slot_waiters:
            self._slots_free -= 1
            return False
        loop = cast("asyncio.AbstractEventLoop", self._loop)
        waiter: asyncio.Future[None] = loop.create_future()
        self._slot_waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and self._state == _OPEN:
                self._release_slot()  # handed a slot we no longer want: pass it on
            raise
        finally:
            if not waiter.done():
                self._slot_waiters.remove(waiter)
        self._check_open()  # woken by the connection's end
        return True

    def _release_slot(self) -> None:
        waiters = self._slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to it directly
                return
        self._slots_free += 1

    def _send(self, data: bytes) -> None:
        """Queue bytes; everything queued in this loop iteration goes out in one write."""
        self._out += data
        if self._flush_handle is None:
            assert self._loop is not None
            self._flush_handle = self._loop.call_soon(self._flush)

    def _send_now(self, data: bytes) -> None:
        self._out += data
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._flush()

    def _flush(self) -> None:
        self._flush_handle = None
        out = self._out
        transport = self._transport
        if not out or transport is None or transport.is_closing():
            return
        self._out = bytearray()  # the transport may keep the old one: never touch it again
        transport.write(out)
        self._last_write = cast("asyncio.AbstractEventLoop", self._loop).time()

    # ------------------------------------------------------------------ transport callbacks

    def _on_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # a socket closing under us
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        now = cast("asyncio.AbstractEventLoop", self._loop).time()
        self._last_read = self._last_write = now

    def _on_lost(self, exc: Exception | None) -> None:
        if self._state != _CLOSED and not isinstance(exc, TimeoutError):
            # Closed from the far side (FIN, RST): the link carried that much. Not a stall
            # the kernel gave up on (ETIMEDOUT), nor an end of ours (a keep-alive abort).
            self._heard(cast("asyncio.AbstractEventLoop", self._loop).time())
        cause = f": {exc}" if exc is not None else " by the broker"
        self._terminate(MqttConnectionLostError(f"connection lost{cause}"))
        if self._abort_handle is not None:
            self._abort_handle.cancel()
            self._abort_handle = None
        lost = self._lost
        if lost is not None and not lost.done():
            lost.set_result(None)

    def _on_data(self, data: bytes) -> None:  # noqa: PLR0912 - one pass per chunk, inlined
        """Parse every complete packet of the chunk and keep the incomplete tail; end the
        connection on anything malformed or unexpected (never raise into the loop)."""
        if self._state == _CLOSED:
            return
        loop = cast("asyncio.AbstractEventLoop", self._loop)
        self._last_read = loop.time()
        if data:  # (empty: the bytes held at a pause, read before it)
            self._heard(self._last_read)
        rest = self._rest
        buffer: bytes | bytearray
        if rest:
            rest += data
            if len(rest) < self._need:
                return  # a large packet still arriving: parse it once, when complete
            buffer = rest
            self._rest = bytearray()  # ``rest`` is never resized again while viewed
        else:
            buffer = data
        self._need = 0
        foreign = self._FOREIGN_CONNACK
        if self._state == _CONNECTING and foreign is not None and buffer[:2] == foreign:
            self._v311_connack(buffer)
            return
        try:
            added, added_bytes = self._parse(buffer)
        except _Violation as violation:
            self._protocol_error(violation)
            return
        except Exception as exc:  # a bug of ours: end this connection, never the loop
            log.error("mqtt5_internal_error", error=repr(exc), **self._where())
            self._terminate(MqttConnectionLostError(f"internal error: {exc!r}"), abort=True)
            return
        if added and self._state == _OPEN:
            self._buffered_bytes += added_bytes
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            if not self._paused:
                if len(self._deliveries) >= self.settings.buffer_high:
                    self._pause("messages")
                elif self._buffered_bytes >= self.buffer_high_bytes:
                    self._pause("bytes")

    def _parse(self, buffer: bytes | bytearray) -> tuple[int, int]:  # noqa: PLR0912, PLR0915 - the hot loop, inlined; codec hook
        """The hot loop, inlined on purpose (no call per PUBLISH): the deliveries added and
        their bytes. Raises _Violation for what must end the connection."""
        view = memoryview(buffer)
        end = len(buffer)
        pos = 0
        read = mqtt5.read
        deliveries = self._deliveries
        unacked = self._unacked
        receive_max = self._receive_max
        intake = not self._intake_stopped
        high, high_bytes = self.settings.buffer_high, self.buffer_high_bytes
        held_bytes = self._buffered_bytes
        added = added_bytes = 0
        while pos < end:
            try:
                packet, size = read(view[pos:])
            except IndexError:  # incomplete: keep the tail for the next chunk
                need = _frame_size(view, pos, end)
                if need is not None and need <= end - pos:
                    raise _Violation(  # noqa: B904 - not a cause: the codec's "not enough bytes"
                        DisconnectReasonCode.MALFORMED_PACKET, "packet shorter than its length"
                    )
                self._rest = bytearray(view[pos:])
                self._need = need or 0
                break
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # ValueError, or the codec's PanicException
                # A PUBACK or DISCONNECT whose reason code the codec does not know (mosquitto's
                # 0x95 in a PUBACK): read by its fixed layout, not taken for malformed.
                unlisted = self._read_unlisted(view, pos, end)
                if unlisted is None:
                    raise _Violation(
                        DisconnectReasonCode.MALFORMED_PACKET, f"undecodable packet: {exc!r}"
                    ) from exc
                pos += unlisted
                if self._state == _CLOSED:
                    break
                continue
            pos += size
            if type(packet) is not PublishPacket:
                self._on_control(packet)
                if self._state == _CLOSED:
                    break
                continue
            if self._state != _OPEN:
                raise _Violation(DisconnectReasonCode.PROTOCOL_ERROR, "PUBLISH before CONNACK")
            qos = packet.qos
            packet_id: int | None = None
            if qos is _QOS1:
                packet_id = cast("int", packet.packet_id)
                if (len(unacked) >= receive_max or packet_id in unacked) and self._overrun(
                    packet_id, resent=packet.duplicate
                ):
                    continue  # sent again before our PUBACK: the copy we hold is the one
                unacked.add(packet_id)
            elif qos is not _QOS0:
                raise _Violation(DisconnectReasonCode.QOS_NOT_SUPPORTED, "QoS 2 PUBLISH received")
            if intake:
                topic = packet.topic
                if not topic:
                    raise _Violation(DisconnectReasonCode.TOPIC_ALIAS_INVALID, "topic alias used")
                payload = packet.payload
                deliveries.append(
                    Delivery(
                        topic,
                        payload,
                        0 if packet_id is None else 1,
                        packet_id,
                        packet.retain,
                        self,
                    )
                )
                added += 1
                added_bytes += len(payload) + len(topic)
                if len(deliveries) >= high or held_bytes + added_bytes >= high_bytes:
                    if pos < end:  # the rest of the chunk waits, unparsed, for the resume
                        self._rest = bytearray(view[pos:])
                        self._held = True
                    break
        return added, added_bytes

    def _overrun(self, packet_id: int, *, resent: bool) -> bool:
        """A QoS 1 PUBLISH whose id is still unacknowledged, or one over our Receive Maximum.
        True: a resend of the message we hold (DUP set), to be dropped. MQTT 5 allows a resend
        only on a new connection, but EMQX resends on the same one after its
        ``mqtt.retry_interval`` (30 s by default, not to be turned off), and the gateway
        acknowledges only after the commit: any commit slower than that (PostgreSQL away, a
        lock) met it, and the connection was ended as a protocol error, again every 30 s.
        The same id without DUP is another message under an id in use: a protocol error."""
        if packet_id in self._unacked:
            if not resent:
                raise _Violation(
                    DisconnectReasonCode.PROTOCOL_ERROR,
                    f"packet id {packet_id} reused before our PUBACK",
                )
            if not self.duplicates_dropped:
                log.warning(
                    "broker_resent_unacknowledged",
                    packet_id=packet_id,
                    note="the broker sent a message again before our PUBACK (EMQX's"
                    " mqtt.retry_interval); the copy is dropped, the message is acknowledged"
                    " once stored; logged once per connection",
                    **self._where(),
                )
            self.duplicates_dropped += 1
            return True
        if self.strict_receive_maximum:
            raise _Violation(
                DisconnectReasonCode.RECEIVE_MAX_EXCEEDED,
                f"more than {self._receive_max} unacknowledged QoS 1 publishes",
            )
        if not self.receive_maximum_overruns:
            log.warning(
                "broker_receive_maximum_exceeded",
                receive_maximum=self._receive_max,
                note="tolerated; reading still pauses at buffer_high",
                **self._where(),
            )
        self.receive_maximum_overruns += 1
        return False

    def _read_unlisted(self, view: memoryview, pos: int, end: int) -> int | None:
        """A complete PUBACK or DISCONNECT at ``pos`` the codec refused: handled from its
        packet id and reason code (properties skipped); its size, or None if it is neither."""
        kind = view[pos] >> 4
        if kind not in (_PUBACK_TYPE, _DISCONNECT_TYPE) or view[pos] & 0x0F:
            return None
        size = _frame_size(view, pos, end)
        if size is None or size > end - pos:
            return None
        body = view[pos + size - _remaining(view, pos) : pos + size]
        if kind == _PUBACK_TYPE:
            if len(body) < 3:
                return None
            self._puback((body[0] << 8) | body[1], body[2])
        else:
            if not body:
                return None
            self._disconnected(body[0], None)
        return size

    def _puback(self, packet_id: int, code: int) -> None:
        future = self._publishes.pop(packet_id, None)
        if future is None:
            raise _Violation(
                DisconnectReasonCode.PROTOCOL_ERROR, f"PUBACK for unknown packet id {packet_id}"
            )
        self._publish_sizes.pop(packet_id, None)
        self._release_slot()
        if not future.done():
            future.set_result(code)

    def _disconnected(self, code: int, reason_str: str | None) -> None:
        known = disconnect_code(code)
        if code == PACKET_TOO_LARGE:
            self._blame_largest()
        log.warning(
            "broker_disconnected",
            reason_code=code,
            reason=known.name,
            meaning=known.meaning,
            reason_str=reason_str,
            learned_max_packet_size=self.learned_max_packet_size,
            **self._where(),
        )
        self._terminate(
            MqttConnectionLostError(
                f"the broker disconnected: {known.name} ({code:#04x}): {known.meaning}", code
            )
        )

    def _blame_largest(self) -> None:
        """DISCONNECT 0x95: fail the largest publishes awaiting their PUBACK as too large, and
        learn a bound below them (never above one already known)."""
        if not self._publish_sizes:
            return
        largest = max(size for size, _ in self._publish_sizes.values())
        bound = largest - 1
        limit = self.packet_limit
        if limit is not None:
            bound = min(bound, limit[0])
        self.learned_max_packet_size = bound
        for packet_id, (size, topic) in list(self._publish_sizes.items()):
            if size != largest:
                continue
            future = self._publishes.pop(packet_id, None)
            del self._publish_sizes[packet_id]
            if future is not None and not future.done():
                future.set_exception(
                    PacketTooLarge(topic, size, bound, "the broker's DISCONNECT 0x95")
                )

    def _on_control(self, packet: mqtt5.Packet) -> None:
        if type(packet) is PubAckPacket:
            self._puback(packet.packet_id, int(packet.reason_code))
        elif type(packet) is PingRespPacket:
            self.pingresps_received += 1
            self._ping_outstanding = False
        elif type(packet) is SubAckPacket:
            self._answered(self._subscribes, "SUBACK", packet.packet_id, packet.reason_codes)
        elif type(packet) is UnsubAckPacket:
            self._answered(self._unsubscribes, "UNSUBACK", packet.packet_id, packet.reason_codes)
        elif type(packet) is ConnAckPacket:
            self._on_connack(packet)
        elif type(packet) is DisconnectPacket:
            self._disconnected(int(packet.reason_code), packet.reason_str)
        else:
            raise _Violation(
                DisconnectReasonCode.PROTOCOL_ERROR,
                f"{type(packet).__name__} is not a packet a client receives here",
            )

    @staticmethod
    def _answered(
        requests: dict[int, asyncio.Future[list[int]]],
        kind: str,
        packet_id: int,
        reason_codes: Sequence[object],
    ) -> None:
        """A SUBACK or UNSUBACK: its one reason code to the request waiting for it."""
        request = requests.pop(packet_id, None)
        if request is None:
            raise _Violation(
                DisconnectReasonCode.PROTOCOL_ERROR, f"{kind} for unknown packet id {packet_id}"
            )
        codes = [int(cast("int", code)) for code in reason_codes]
        if len(codes) != 1:
            raise _Violation(
                DisconnectReasonCode.PROTOCOL_ERROR,
                f"{kind} with {len(codes)} reason codes for one topic filter",
            )
        if not request.done():
            request.set_result(codes)

    def _v311_connack(self, buffer: bytes | bytearray) -> None:
        """A CONNACK in MQTT 3.1.1's format (remaining length 2, no properties): the broker
        does not speak MQTT 5 (it answers a version it cannot accept so, [MQTT-3.1.2-2])."""
        code = buffer[3] if len(buffer) >= 4 else None
        log.warning("broker_speaks_mqtt311_only", return_code=code, **self._where())
        self._terminate(
            MqttConnectError(
                f"connection refused: the broker answered in MQTT 3.1.1 (return code {code}):"
                " it does not speak MQTT 5",
                UNSUPPORTED_PROTOCOL_VERSION,
            )
        )

    def _on_connack(self, packet: ConnAckPacket) -> None:
        if self._state != _CONNECTING:
            raise _Violation(DisconnectReasonCode.PROTOCOL_ERROR, "second CONNACK")
        connack = cast("asyncio.Future[ConnAckPacket | Mqtt5Error | None]", self._connack)
        code = int(packet.reason_code)
        if code != 0:
            reason = packet.reason_code.name
            error = MqttConnectError(f"connection refused: {reason} ({code})", code)
            self._terminate(error)
            return
        self._state = _OPEN
        self.session_present = packet.session_present
        if packet.server_keep_alive is not None:
            self.keep_alive = packet.server_keep_alive
        self._send_max = self._slots_free = packet.receive_max
        self._max_qos = min(1, int(packet.max_qos))
        self._retain_available = packet.retain_available
        self._max_packet_size = packet.max_packet_size
        self.capabilities = BrokerCapabilities(
            protocol="5",
            shared_subscriptions=packet.shared_subscription_available,
            wildcard_subscriptions=packet.wildcard_subscription_available,
            max_qos=int(packet.max_qos),
            retain=packet.retain_available,
            max_packet_size=packet.max_packet_size,
            receive_maximum=packet.receive_max,
            session_expiry_s=packet.session_expiry_interval,
            server_keep_alive_s=packet.server_keep_alive,
            session_present=packet.session_present,
        )
        if self.keep_alive > 0:
            loop = cast("asyncio.AbstractEventLoop", self._loop)
            self._timer = loop.call_at(loop.time() + self.keep_alive, self._tick)
        if not connack.done():
            connack.set_result(packet)

    # ------------------------------------------------------------------ flow control

    def _pause(self, bound: str) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.pause_reading()  # also when re-parsing held bytes: a no-op then
        self._paused = True
        self.pauses += 1
        if self.on_pause is not None:
            self.on_pause(bound)

    def _maybe_resume(self) -> None:
        if not (
            (
                len(self._deliveries) <= self.settings.buffer_high // 2
                and self._buffered_bytes <= self.buffer_high_bytes // 2
            )
            or self._intake_stopped
        ):
            return
        self._paused = False
        if self._held:  # first what was read but not parsed when reading paused
            self._held = False
            self._on_data(b"")
            if self._paused or self._state == _CLOSED:
                return
        transport = self._transport
        if transport is not None and not transport.is_closing():
            # Silence while we did not read was ours: the dead-connection clock restarts.
            self._last_read = cast("asyncio.AbstractEventLoop", self._loop).time()
            transport.resume_reading()

    # ------------------------------------------------------------------ keep-alive

    def _tick(self) -> None:
        self._timer = None
        if self._state != _OPEN:
            return
        loop = cast("asyncio.AbstractEventLoop", self._loop)
        now = loop.time()
        interval = self.keep_alive
        if not self._paused and now - self._last_read >= _DEAD_AFTER * interval:
            log.warning(
                "broker_keepalive_timeout",
                keepalive_s=interval,
                silent_s=round(now - self._last_read, 3),
                **self._where(),
            )
            self._terminate(
                MqttKeepAliveError(
                    f"nothing received from the broker for {_DEAD_AFTER * interval}s"
                ),
                abort=True,
            )
            return
        quiet_read = not self._paused and now - self._last_read >= interval
        if now - self._last_write >= interval or (quiet_read and not self._ping_outstanding):
            self._ping_outstanding = True
            self.pings_sent += 1
            self._send_now(_PINGREQ)
        due = self._last_write + interval
        if not self._paused:
            due = min(due, self._last_read + _DEAD_AFTER * interval)
            if not self._ping_outstanding:
                due = min(due, self._last_read + interval)
        self._timer = loop.call_at(max(due, now + 0.001), self._tick)

    # ------------------------------------------------------------------ ending

    def _where(self) -> dict[str, object]:
        s = self.settings
        return {"host": s.host, "port": s.port, "client_id": s.client_id}

    def _protocol_error(self, violation: _Violation) -> None:
        log.warning(
            "broker_protocol_error",
            reason=violation.code.name,
            detail=violation.detail,
            **self._where(),
        )
        self._terminate(
            MqttProtocolError(
                f"protocol error from the broker: {violation.detail}", int(violation.code)
            ),
            disconnect=violation.code,
        )

    def _terminate(
        self,
        error: Mqtt5Error,
        *,
        disconnect: DisconnectReasonCode | None = None,
        abort: bool = False,
    ) -> None:
        """End the connection once: fail whoever waits, send what is queued (and a DISCONNECT
        when asked) unless aborting, then close the transport."""
        if self._state == _CLOSED:
            return
        was_open = self._state == _OPEN
        self._state = _CLOSED
        self._error = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._close_transport(disconnect if was_open else None, abort=abort)
        self._out = bytearray()
        self._deliveries.clear()
        self._buffered_bytes = 0
        self._wake_all(error)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    def _close_transport(self, disconnect: DisconnectReasonCode | None, *, abort: bool) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if abort:
            transport.abort()
            return
        out = self._out
        if disconnect is not None:
            out += self._disconnect_packet(disconnect)
        if out:
            transport.write(out)
        transport.close()
        # A peer that stopped reading would hold the close forever.
        loop = cast("asyncio.AbstractEventLoop", self._loop)
        self._abort_handle = loop.call_later(self.settings.timeout_s, transport.abort)

    def _heard(self, now: float) -> None:
        self._heard_at = now
        if self._hear_waiters:
            self._wake_hearers()

    def _wake_hearers(self) -> None:
        waiters, self._hear_waiters = self._hear_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _wake_all(self, error: Mqtt5Error) -> None:
        self._wake_hearers()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._connack is not None and not self._connack.done():
            self._connack.set_result(error)
        publishes, self._publishes = self._publishes, {}
        for future in publishes.values():
            if not future.done():
                future.set_exception(error)
        subscribes, self._subscribes = self._subscribes, {}
        unsubscribes, self._unsubscribes = self._unsubscribes, {}
        for sub in [*subscribes.values(), *unsubscribes.values()]:
            if not sub.done():
                sub.set_exception(error)
        waiters, self._slot_waiters = self._slot_waiters, collections.deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def _frame_size(view: memoryview, pos: int, end: int) -> int | None:
    """Size of the packet starting at ``pos`` from its fixed header; None if the header itself
    is incomplete. A remaining length longer than four bytes is malformed."""
    length = 0
    shift = 0
    index = pos + 1
    for _ in range(4):
        if index >= end:
            return None
        byte = view[index]
        index += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return index - pos + length
        shift += 7
    raise _Violation(DisconnectReasonCode.MALFORMED_PACKET, "remaining length over four bytes")


def _remaining(view: memoryview, pos: int) -> int:
    """The remaining length of the complete packet at ``pos`` (its header already checked)."""
    length = shift = 0
    index = pos + 1
    while True:
        byte = view[index]
        index += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return length
        shift += 7


def _reason_name(codes: object, code: int) -> str:
    for name in dir(codes):
        if name.isupper() and int(getattr(codes, name)) == code:
            return name
    return "UNKNOWN"


def disconnect_reason(code: int) -> DisconnectReasonCode:
    """The codec's DISCONNECT reason for a numeric code (ValueError if MQTT 5 has none)."""
    try:
        return _DISCONNECT_CODES[code]
    except KeyError:
        raise ValueError(f"no DISCONNECT reason code {code}") from None
