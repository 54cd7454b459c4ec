"""The one place that reaches under aiomqtt: QoS 1 acknowledged only when we say so.

aiomqtt 2.5 acknowledges every message as soon as paho hands it over. The gateway must
send PUBACK only after the transaction that stored the message committed, so that a
crash before the commit makes the broker redeliver. paho supports that (``manual_ack``);
this adapter switches it on before connecting and exposes ``ack(message)``.

It also gives reading real backpressure. aiomqtt reads the socket whenever data arrives and
queues every message without bound, and the broker's window of unacknowledged messages does
not bound that queue in practice: mosquitto 2.0.11, resuming a session with a backlog, keeps
sending far past the client's ReceiveMaximum once acknowledgements flow in batches (measured:
23,499 messages buffered with a window of 1,000). So the adapter stops reading the socket
while more than ``buffer_high`` messages, or more than ``buffer_high_bytes`` bytes of payload,
wait in aiomqtt's queue, and resumes once both are below half; TCP flow control then holds the
rest in the broker. (A count alone does not bound memory: 40 payloads of 10 MB each fit well
under any sensible message bound.)

Each ``AckingClient`` is one connection. A message may only be acknowledged on the
connection that delivered it: after a reconnect the broker redelivers whatever was not
acknowledged and may reuse packet ids, so an ack on the new connection could confirm a
different message. ``ack`` on a closed connection is therefore a no-op returning False.

Closing settles the acknowledgements first. A PUBACK written to the socket is not yet one the
broker handled: mosquitto reads a client's packets a few at a time, and a new connection with
the same client id (the next session, at once) takes the session over and closes the old
connection with the rest of its packets unread, so acknowledged messages come back. DISCONNECT
has no answer, so before it the close makes one round trip that the broker answers only after
everything sent before it (an UNSUBSCRIBE of a filter never subscribed: the UNSUBACK), within
the connection's ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import socket
import ssl
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Literal, Self, cast

import aiomqtt
import paho.mqtt.client as paho
import structlog
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from gateway.domain.errors import StartupError
from gateway.support.publish_refusal import PacketTooLarge, publish_packet_size

log = structlog.get_logger(__name__)

# The bound that paused reading: the message count or the payload bytes buffered.
BOUND_MESSAGES = "messages"
BOUND_BYTES = "bytes"


@dataclass(frozen=True, slots=True)
class TlsSettings:
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure: bool = False
    # The context made by load(), at start: every connection takes it, and the files are not
    # read again (a key credential gone, a certificate renewed half-written at a reconnect).
    loaded: ssl.SSLContext | None = field(default=None, compare=False, repr=False)

    def context(self) -> ssl.SSLContext:
        if self.loaded is not None:
            return self.loaded
        context = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file or None)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def load(self) -> TlsSettings:
        """These settings with their context made now, from the files as they are.

        Raises :class:`StartupError` (a configuration to change) naming the key whose file
        cannot be read or does not hold what the key says: read at the first connect, after
        the migration, such a file was a traceback and exit 1, restarted by the units forever.
        """
        if self.loaded is not None:
            return self
        try:
            ssl.create_default_context(cafile=self.ca_file or None)
        except OSError as exc:  # ssl.SSLError too
            where = self.ca_file or "the system's trust store"
            raise _tls_error("ca_file", f"cannot use the CA file {where}: {_why(exc)}") from None
        for key, path in (("cert_file", self.cert_file), ("key_file", self.key_file)):
            try:
                if path:
                    with open(path, "rb"):
                        pass
            except OSError as exc:
                raise _tls_error(key, f"cannot read {path}: {_why(exc)}") from None
        try:
            context = self.context()
        except OSError as exc:
            key = self.key_file or "(the certificate file)"
            raise _tls_error(
                "cert_file, [mqtt.tls] key_file",
                f"cannot use the client certificate {self.cert_file} with the key {key}: "
                f"{_why(exc)}",
            ) from None
        return dataclasses.replace(self, loaded=context)


def _tls_error(key: str, message: str) -> StartupError:
    return StartupError(message, setting=f"[mqtt.tls] {key}", configuration=True)


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    host: str
    port: int
    client_id: str
    protocol: Literal["3.1.1", "5"] = "5"
    persistent_session: bool = True
    session_expiry_s: int = 86400
    receive_maximum: int = 1000
    keepalive_s: int = 30
    username: str = ""
    password: str = ""
    tls: TlsSettings | None = None
    will_topic: str = ""
    will_payload: bytes = b""
    timeout_s: float = 10.0
    buffer_high: int = 1000
    buffer_high_bytes: int = 16 * 1024 * 1024
    # Our bound on a publish packet ([mqtt] max_packet_size; 0: none of ours). MQTT 5 also
    # keeps to the broker's Maximum Packet Size from CONNACK; 3.1.1 has no way to learn one.
    max_packet_size: int = 0


class _FlowQueue(asyncio.Queue[aiomqtt.Message]):
    """aiomqtt's incoming queue, telling its owner when to stop and resume reading."""

    def __init__(self, maxsize: int = 0, *, owner: AckingClient) -> None:
        super().__init__(maxsize)
        self._owner = owner

    def put_nowait(self, item: aiomqtt.Message) -> None:
        owner = self._owner
        if owner.intake_stopped:
            return  # never acknowledged: the broker redelivers it to the next session
        super().put_nowait(item)
        owner.delivered.add(item)
        owner.buffered_bytes += _size(item)
        settings = owner.settings
        if self.qsize() >= settings.buffer_high:
            owner.pause_reading(BOUND_MESSAGES)
        elif owner.buffered_bytes >= settings.buffer_high_bytes:
            owner.pause_reading(BOUND_BYTES)

    def get_nowait(self) -> aiomqtt.Message:
        item = super().get_nowait()
        owner = self._owner
        owner.buffered_bytes -= _size(item)
        settings = owner.settings
        if (
            self.qsize() <= settings.buffer_high // 2
            and owner.buffered_bytes <= settings.buffer_high_bytes // 2
        ):
            owner.resume_reading()
        return item


def _size(message: aiomqtt.Message) -> int:
    payload = message.payload
    return len(payload) if isinstance(payload, bytes | bytearray) else 0


class AckingClient:
    """An aiomqtt connection whose QoS 1 deliveries wait for ``ack()``."""

    def __init__(
        self, settings: ConnectionSettings, *, on_pause: Callable[[str], None] | None = None
    ) -> None:
        self.settings = settings
        self._client: aiomqtt.Client | None = None
        self._open = False
        self._paused_fd: int | None = None
        self.pauses = 0
        # Pauses by the bound that was reached (BOUND_MESSAGES, BOUND_BYTES).
        self.pauses_by_bound: dict[str, int] = {BOUND_MESSAGES: 0, BOUND_BYTES: 0}
        self.on_pause = on_pause
        # Payload bytes read off the socket and not yet taken by our reader.
        self.buffered_bytes = 0
        self.intake_stopped = False
        # What this connection delivered and has not acknowledged yet (weak: nothing is kept
        # alive by it).
        self.delivered: weakref.WeakSet[aiomqtt.Message] = weakref.WeakSet()
        # PUBACKs handed to paho that the broker has not been seen to handle (see close).
        self.unsettled_acks = 0

    def _build(self) -> aiomqtt.Client:
        s = self.settings
        v5 = s.protocol == "5"
        properties = None
        if v5:
            properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]  # paho is untyped
            properties.SessionExpiryInterval = s.session_expiry_s if s.persistent_session else 0
            properties.ReceiveMaximum = s.receive_maximum
        will = None
        if s.will_topic:
            will = aiomqtt.Will(s.will_topic, s.will_payload, qos=1, retain=True)
        client = aiomqtt.Client(
            s.host,
            s.port,
            identifier=s.client_id,
            protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311,
            # v3.1.1 keeps the session with clean_session=False; v5 with clean_start=False
            # plus a session expiry (paho refuses clean_session on v5).
            clean_session=None if v5 else not s.persistent_session,
            clean_start=not s.persistent_session if v5 else paho.MQTT_CLEAN_START_FIRST_ONLY,
            properties=properties,
            keepalive=s.keepalive_s,
            username=s.username or None,
            password=s.password or None,
            tls_context=s.tls.context() if s.tls else None,
            will=will,
            timeout=s.timeout_s,
            queue_type=cast(
                "type[asyncio.Queue[aiomqtt.Message]]", functools.partial(_FlowQueue, owner=self)
            ),
        )
        client._client.manual_ack_set(True)  # the reason this adapter exists
        return client

    async def __aenter__(self) -> Self:
        self._client = self._build()
        await self._client.__aenter__()
        no_delay(self._paho_socket())
        self._open = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        assert self._client is not None
        await self.settle_acks()
        await self._client.__aexit__(exc_type, exc, tb)

    async def settle_acks(self) -> bool:
        """Wait, up to ``timeout_s``, until the broker handled the PUBACKs given so far: one
        round trip it answers only after them. Nothing more is taken meanwhile (what arrives
        stays unacknowledged, for the next session). True when settled (or none was given);
        False, logged, when the connection is gone or the broker does not answer in time."""
        client = self._client
        if self.unsettled_acks == 0 or client is None:
            return True
        given, self.unsettled_acks = self.unsettled_acks, 0
        if client._disconnected.done():
            log.info("mqtt_acks_unsettled", acks=given, reason="connection lost")
            return False
        self.stop_intake()  # and read on: the answer must get through a paused reader
        try:
            await client.unsubscribe(SETTLE_FILTER, timeout=self.settings.timeout_s)
        except aiomqtt.MqttError as exc:
            log.warning("mqtt_acks_unsettled", acks=given, reason=str(exc))
            return False
        return True

    @property
    def buffered(self) -> int:
        """Messages read from the socket and not yet taken by our reader."""
        return 0 if self._client is None else len(self._client.messages)

    @property
    def reading_paused(self) -> bool:
        return self._paused_fd is not None

    def stop_intake(self) -> None:
        """Take no more messages (shutdown): they stay unacknowledged, so the broker keeps
        them, and reading resumes so that replies to our own requests still arrive."""
        self.intake_stopped = True
        self.resume_reading()

    def pause_reading(self, bound: str = BOUND_MESSAGES) -> None:
        sock = self._paho_socket()
        if self._paused_fd is not None or sock is None:
            return
        fd = sock.fileno()
        if fd < 0:
            return
        asyncio.get_running_loop().remove_reader(fd)
        self._paused_fd = fd
        self.pauses += 1
        self.pauses_by_bound[bound] = self.pauses_by_bound.get(bound, 0) + 1
        if self.on_pause is not None:
            self.on_pause(bound)

    def resume_reading(self) -> None:
        fd, self._paused_fd = self._paused_fd, None
        sock = self._paho_socket()
        if fd is None or sock is None or sock.fileno() != fd:
            return  # the connection closed meanwhile: nothing to resume
        asyncio.get_running_loop().add_reader(fd, self._on_readable)
        # Bytes that arrived while paused do not re-trigger readiness on some loops.
        self._on_readable()

    def _paho_socket(self) -> Any:
        return None if self._client is None else self._client._client.socket()

    def _on_readable(self) -> None:
        """What aiomqtt registers for the socket, re-registered after a pause."""
        assert self._client is not None
        paho_client = self._client._client
        try:
            while self._paused_fd is None:
                paho_client.loop_read()
                # TLS sockets may hold decoded bytes the selector does not see.
                pending = getattr(paho_client.socket(), "pending", None)
                if pending is None or pending() <= 0:
                    break
        except Exception as exc:  # aiomqtt treats any read error as a disconnect
            disconnected = self._client._disconnected
            if not disconnected.done():
                disconnected.set_exception(exc)

    @property
    def client(self) -> aiomqtt.Client:
        if self._client is None:
            raise RuntimeError("not connected")
        return self._client

    @property
    def is_open(self) -> bool:
        """Connected, and the broker has not dropped us (paho learns of it before we exit)."""
        client = self._client
        return self._open and client is not None and not client._disconnected.done()

    @property
    def messages(self) -> aiomqtt.client.MessagesIterator:
        return self.client.messages

    def ack(self, message: aiomqtt.Message) -> bool:
        """Send the PUBACK for a message this connection delivered; False if it is gone."""
        if message.qos == 0:
            return True
        # Only a message this very connection delivered, once: after a reconnect the broker
        # redelivers under the old packet id, so acking a message of another connection would
        # confirm the unprocessed copy (and lose it).
        if not self.is_open or message not in self.delivered:
            return False
        self.delivered.discard(message)
        assert self._client is not None
        rc = self._client._client.ack(message.mid, message.qos)
        if rc != paho.MQTT_ERR_SUCCESS:
            return False
        self.unsettled_acks += 1
        return True

    async def subscribe(self, topic: str, qos: int = 1, *, wait_s: float | None = None) -> None:
        """``wait_s`` None: the connection's default; ``math.inf``: as long as it lives. A
        SUBACK refusing the filter (0x80) raises :class:`SubscriptionRefusedError`: paho only
        reports it, and a subscription the broker refused delivers nothing, silently."""
        granted = await self.client.subscribe(topic, qos=qos, timeout=wait_s)
        for code in granted:
            value = code.value if isinstance(code, ReasonCode) else int(code)
            if value >= SUBACK_FAILURE:
                name = code.getName() if isinstance(code, ReasonCode) else "Failure"
                raise SubscriptionRefusedError(topic, value, name)

    async def unsubscribe(self, topic: str, *, wait_s: float | None = None) -> int | None:
        """Remove a subscription; None once the UNSUBACK came (3.1.1's carries no code)."""
        await self.client.unsubscribe(topic, timeout=wait_s)
        return None

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        wait_s: float | None = None,
    ) -> int | None:
        """None: a 3.1.1 PUBACK carries no reason code, so it cannot say whether anyone was
        subscribed (see docs/behaviour.md §5: on 3.1.1 an event publish never counts as a push).
        A packet over ``settings.max_packet_size`` raises :class:`PacketTooLarge` unsent: a 3.1.1
        broker cannot say why it refuses one (it closes the connection), so it is never sent."""
        limit = self.settings.max_packet_size
        if limit:
            size = publish_packet_size(topic, len(payload), qos=qos, mqtt5=False)
            if size > limit:
                raise PacketTooLarge(topic, size, limit, "[mqtt] max_packet_size")
        await self.client.publish(topic, payload, qos=qos, retain=retain, timeout=wait_s)
        return None


# A filter never subscribed: unsubscribing it changes nothing, and its UNSUBACK says the broker
# handled every packet sent before (see "Closing settles the acknowledgements" above).
SETTLE_FILTER: Final = "gateway-close/settle-acks"

# SUBACK reason codes from here up refuse the subscription (0x80 is 3.1.1's only one).
SUBACK_FAILURE: Final = 0x80


class SubscriptionRefusedError(aiomqtt.MqttError):
    """The broker's SUBACK refused a topic filter (reason code 0x80 or more): an ACL, shared
    subscriptions not supported or not allowed. No retry changes that; a change of the
    broker's configuration or of ours does."""

    # None only to share the attribute with Mqtt5Error (MqttSubscribeError is both).
    reason_code: int | None

    def __init__(self, topic: str, reason_code: int, reason: str) -> None:
        super().__init__(f"subscribe to {topic!r} refused: {reason} ({reason_code})")
        self.topic = topic
        self.reason_code = reason_code
        self.reason = reason


def no_delay(sock: Any) -> None:
    """Send small packets at once (TCP_NODELAY); paho leaves Nagle's algorithm on.

    With Nagle on, a PUBACK or a downlink written while an earlier segment is unacknowledged
    waits for the peer's delayed ACK: 40 ms on Linux, on every command round trip.
    """
    if sock is not None and getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
