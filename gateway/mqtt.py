"""The one place that reaches under aiomqtt: QoS 1 acknowledged only when we say so.

aiomqtt 2.5 acknowledges every message as soon as paho hands it over. The gateway must
send PUBACK only after the transaction that stored the message committed, so that a
crash before the commit makes the broker redeliver. paho supports that (``manual_ack``);
this adapter switches it on before connecting and exposes ``ack(message)``.

Each ``AckingClient`` is one connection. A message may only be acknowledged on the
connection that delivered it: after a reconnect the broker redelivers whatever was not
acknowledged and may reuse packet ids, so an ack on the new connection could confirm a
different message. ``ack`` on a closed connection is therefore a no-op returning False.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


@dataclass(frozen=True, slots=True)
class TlsSettings:
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure: bool = False

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file or None)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


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


class AckingClient:
    """An aiomqtt connection whose QoS 1 deliveries wait for ``ack()``."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self._client: aiomqtt.Client | None = None
        self._open = False

    def _build(self) -> aiomqtt.Client:
        s = self.settings
        v5 = s.protocol == "5"
        properties = None
        if v5:
            properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
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
        )
        client._client.manual_ack_set(True)  # the reason this adapter exists
        return client

    async def __aenter__(self) -> Self:
        self._client = self._build()
        await self._client.__aenter__()
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
        await self._client.__aexit__(exc_type, exc, tb)

    @property
    def client(self) -> aiomqtt.Client:
        if self._client is None:
            raise RuntimeError("not connected")
        return self._client

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def messages(self) -> aiomqtt.client.MessagesIterator:
        return self.client.messages

    def ack(self, message: aiomqtt.Message) -> bool:
        """Send the PUBACK for a message this connection delivered; False if it is gone."""
        if message.qos == 0:
            return True
        if not self._open or self._client is None:
            return False
        rc = self._client._client.ack(message.mid, message.qos)
        return rc == paho.MQTT_ERR_SUCCESS

    async def subscribe(self, topic: str, qos: int = 1) -> None:
        await self.client.subscribe(topic, qos=qos)

    async def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False
    ) -> None:
        await self.client.publish(topic, payload, qos=qos, retain=retain)
