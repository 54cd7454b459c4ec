"""The broker connection loop: connect, subscribe, read into the pipeline, reconnect."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Any, Final

import aiomqtt
import structlog
from paho.mqtt.reasoncodes import ReasonCode

from gateway.domain.errors import StartupError
from gateway.ingest.decoder import Inbound
from gateway.ingest.writer import IngestWriter
from gateway.mqtt.v5_connection import Mqtt5Connection, MqttConnectError
from gateway.mqtt.v311_client import AckingClient, ConnectionSettings, SubscriptionRefusedError
from gateway.support.backoff import Backoff
from gateway.support.loops import sleep_unless_stopped
from gateway.support.metrics import Metrics

# MQTT 5 speaks through our own client on the mqtt5 codec (parsing is the hot path: about 15x
# paho's rate); MQTT 3.1.1 — the embedded amqtt broker's only version — through aiomqtt.
BrokerConnection = AckingClient | Mqtt5Connection

log = structlog.get_logger(__name__)

BROKER_SETTING: Final = "[mqtt] host, [mqtt] port"
_CREDENTIALS: Final = "[mqtt] username, [mqtt] password (or GATEWAY_MQTT_PASSWORD)"
# CONNACK reason codes (MQTT 5; paho maps 3.1.1's return codes 2, 4, 5 onto them) that no
# retry can change: the setting to fix for each.
_REFUSALS: Final = {
    0x85: "[mqtt] client_id",  # client identifier not valid
    0x86: _CREDENTIALS,  # bad user name or password
    0x87: _CREDENTIALS,  # not authorized
    0x8A: _CREDENTIALS,  # banned
    0x8C: _CREDENTIALS,  # bad authentication method
}

ONLINE = b"online"
OFFLINE = b"offline"


class MqttSession:
    """Owns the broker connection; on stop it drains the pipeline before disconnecting.

    Shutdown order: stop reading → wait until every queued message is stored and
    acknowledged (bounded by ``drain_timeout_s``) → publish the retained ``offline``
    presence → disconnect. Messages still unacknowledged then are redelivered by the broker
    to whichever node holds the session next; their event ids make that harmless.
    """

    def __init__(
        self,
        *,
        settings: ConnectionSettings,
        subscriptions: Sequence[str],
        presence_topic: str,
        writer: IngestWriter,
        metrics: Metrics,
        backoff: Backoff,
        drain_timeout_s: float,
        on_connected: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.subscriptions = tuple(subscriptions)
        self.presence_topic = presence_topic
        self.writer = writer
        self.metrics = metrics
        self.backoff = backoff
        self.drain_timeout_s = drain_timeout_s
        self.on_connected = on_connected
        self.connected = False
        self.connections = 0
        # Sessions that got as far as subscribed: until the first, a refusal is final.
        self.established = 0
        # Connected and every subscription acknowledged: only then does telemetry flow (a
        # broker that lost the session's `$share` subscriptions, as mosquitto does across
        # its own restart, delivers nothing to the group until they are made again).
        self.subscribed = False
        self.client: BrokerConnection | None = None
        # The bound our publishes keep to, besides the broker's CONNACK: [mqtt] max_packet_size,
        # lowered for good when the broker disconnects us for a packet too large (0x95), so
        # that no message drops the connection twice (gateway.mqtt.v5_connection).
        self.max_packet_size: int | None = settings.max_packet_size or None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            client = self.client = self._connection()
            try:
                async with client:
                    await self._serve(client, stop)
                    return
            except SubscriptionRefusedError as exc:
                self.metrics.mqtt_connects.labels("error").inc()
                setting = _subscription_setting(exc.topic)
                if self.established == 0:
                    # The broker takes the connection but not the subscription: an ACL, or
                    # shared subscriptions not supported or not allowed. Retrying changes
                    # nothing, and a node that cannot subscribe cannot ingest: final.
                    raise StartupError(
                        f"the broker at {self.settings.host}:{self.settings.port} refused the "
                        f"subscription {exc.topic!r}: {exc.reason} (reason code "
                        f"{exc.reason_code})",
                        setting=setting,
                        configuration=True,
                    ) from None
                # Refused after it was once accepted (the broker's ACL changed): say so, and
                # wait for it to be allowed again, as for a CONNACK refused later on.
                delay = self.backoff.next_delay()
                log.error(
                    "subscription_refused",
                    host=self.settings.host,
                    port=self.settings.port,
                    topic=exc.topic,
                    reason_code=exc.reason_code,
                    error=str(exc),
                    retry_in_s=round(delay, 3),
                    setting=setting,
                )
            except aiomqtt.MqttError as exc:
                self.metrics.mqtt_connects.labels("error").inc()
                refused = _refusal(exc)
                if refused is not None and self.connections == 0:
                    # Never connected yet: the broker will refuse these settings however
                    # long we retry. (Refused later, say after a password rotation, we wait.)
                    code, setting = refused
                    raise StartupError(
                        f"the broker at {self.settings.host}:{self.settings.port} refused the "
                        f"connection: {exc} (reason code {code})",
                        setting=setting,
                        configuration=True,
                    ) from None
                delay = self.backoff.next_delay()
                log.warning(
                    "broker_unavailable",
                    host=self.settings.host,
                    port=self.settings.port,
                    error=str(exc),
                    retry_in_s=round(delay, 3),
                    setting=BROKER_SETTING,
                )
            finally:
                self._set_connected(False)
                self._learn(client)
            await sleep_unless_stopped(stop, delay)

    def _connection(self) -> BrokerConnection:
        settings = self.settings
        if settings.protocol == "5":
            # Tolerant: mosquitto 2.0.11 sends past our Receive Maximum once PUBACKs flow (the
            # read buffer's bounds still hold memory); a strict client would reconnect forever.
            return Mqtt5Connection(
                settings,
                buffer_high_bytes=settings.buffer_high_bytes,
                strict_receive_maximum=False,
                on_pause=self._paused,
                max_packet_size=self.max_packet_size,
            )
        return AckingClient(settings, on_pause=self._paused)

    async def _serve(self, client: BrokerConnection, stop: asyncio.Event) -> None:
        self.connections += 1
        self.metrics.mqtt_connects.labels("ok").inc()
        self._set_connected(True)
        # Read from the first moment: a resumed session delivers its backlog right after
        # CONNACK, and the SUBACK queues behind it. Not reading would stall the subscribe.
        reader = asyncio.create_task(self._read(client), name="mqtt-reader")
        try:
            setup = asyncio.create_task(self._subscribe(client), name="mqtt-subscribe")
            if await self._until(setup, reader, stop):
                self.established += 1
                self.subscribed = True
                self.backoff.reset()
                log.info(
                    "broker_connected",
                    host=self.settings.host,
                    port=self.settings.port,
                    client_id=self.settings.client_id,
                    subscriptions=list(self.subscriptions),
                )
                if self.on_connected is not None:
                    self.on_connected()
                await self._until(None, reader, stop)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        drained = await self.writer.drain(self.drain_timeout_s)
        if not drained:
            log.warning(
                "drain_timeout",
                pending=self.writer.queue.qsize(),
                note="unacknowledged messages will be redelivered by the broker",
            )
        # Messages still arriving now are left unacknowledged (the broker keeps them for the
        # next session) so that the PUBACK of the offline presence can be read.
        client.stop_intake()
        await client.publish(self.presence_topic, OFFLINE, qos=1, retain=True)
        log.info("broker_disconnecting", drained=drained)

    async def _subscribe(self, client: BrokerConnection) -> None:
        # No call timeout: behind a large backlog the SUBACK may take as long as the backlog
        # takes to drain. A dead connection ends the reader instead, which _until watches.
        for topic in self.subscriptions:
            await client.subscribe(topic, qos=1, wait_s=math.inf)
        await client.publish(self.presence_topic, ONLINE, qos=1, retain=True, wait_s=math.inf)

    async def _until(
        self, step: asyncio.Task[None] | None, reader: asyncio.Task[None], stop: asyncio.Event
    ) -> bool:
        """Wait for ``step`` (None: forever) while the connection lives and no stop comes.

        True when the step finished; False when stop was set; raises MqttError when the
        connection dropped (the reader ended).
        """
        stopper = asyncio.create_task(stop.wait(), name="mqtt-stop")
        waiting: set[asyncio.Future[Any]] = {reader, stopper}
        if step is not None:
            waiting.add(step)
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if step is not None and not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
        if step is not None and step.done() and not step.cancelled():
            step.result()  # re-raises a failed subscribe
            return True
        if stop.is_set():
            return False
        reader.result()  # re-raises the disconnect
        raise aiomqtt.MqttError("message stream ended")

    async def _read(self, client: BrokerConnection) -> None:
        if isinstance(client, Mqtt5Connection):
            await self._read_batches(client)
            return
        loop = asyncio.get_running_loop()
        writer = self.writer
        admit = writer.decoder.admit
        async for message in client.messages:
            payload = message.payload
            assert isinstance(payload, bytes | bytearray)  # paho delivers bytes
            kept, size, sha256 = admit(bytes(payload))
            if size is not None:
                # Neither the message (kept for its PUBACK, which needs its mid and qos only)
                # nor this frame may keep the whole oversized payload alive while it waits.
                message.payload = kept
                del payload
            await writer.put(
                Inbound(
                    topic=message.topic.value,
                    payload=kept,
                    received_at=loop.time(),
                    acker=client,
                    message=message,
                    size=size,
                    sha256=sha256,
                )
            )

    async def _read_batches(self, client: Mqtt5Connection) -> None:
        """The MQTT 5 reader: whatever arrived, up to a batch, handed over at once."""
        loop = asyncio.get_running_loop()
        writer = self.writer
        admit = writer.decoder.admit
        limit, queue = writer.batch_size, writer.queue
        while True:
            # Never more than the queue has room for: a full queue blocks the one message in
            # hand, and reading stops as before (the bound is the queue's, not the batch's).
            room = queue.maxsize - queue.qsize() if queue.maxsize > 0 else limit
            deliveries = await client.take(max(1, min(limit, room)))
            received_at = loop.time()
            items = []
            for delivery in deliveries:
                kept, size, sha256 = admit(delivery.payload)
                if size is not None:
                    delivery.payload = kept  # see _read
                items.append(
                    Inbound(delivery.topic, kept, received_at, client, delivery, size, sha256)
                )
            await writer.put_many(items)

    def _learn(self, client: BrokerConnection) -> None:
        learned = client.learned_max_packet_size if isinstance(client, Mqtt5Connection) else None
        if learned is not None and (self.max_packet_size is None or learned < self.max_packet_size):
            self.max_packet_size = learned
            log.warning(
                "max_packet_size_learned",
                max_packet_size=learned,
                setting="[mqtt] max_packet_size",
                note="the broker disconnected us for a packet too large (0x95); publishes "
                "over this are refused unsent from now on",
            )

    @property
    def packet_limit(self) -> int | None:
        """The bound a publish keeps to now (the broker's, ours or learned; None: none)."""
        client = self.client
        if isinstance(client, Mqtt5Connection) and client.is_open:
            limit = client.packet_limit
            return None if limit is None else limit[0]
        return self.max_packet_size

    def _paused(self, bound: str) -> None:
        self.metrics.read_pauses.labels(bound).inc()

    def _set_connected(self, connected: bool) -> None:
        self.connected = connected
        if not connected:
            self.subscribed = False
        self.metrics.mqtt_connected.set(1 if connected else 0)


def _refusal(exc: aiomqtt.MqttError) -> tuple[int, str] | None:
    """The CONNACK code and the setting to fix, when the broker refused us for good."""
    if isinstance(exc, MqttConnectError):
        code = exc.reason_code
    elif isinstance(exc, aiomqtt.MqttCodeError) and exc.rc is not None:
        code = exc.rc.value if isinstance(exc.rc, ReasonCode) else _V311_REFUSALS.get(exc.rc)
    else:
        return None
    if code is None or code not in _REFUSALS:
        return None
    return code, _REFUSALS[code]


def _subscription_setting(topic: str) -> str:
    """What to change when the broker refuses ``topic``."""
    if topic.startswith("$share/"):
        return "[mqtt] shared_group (empty: no shared subscription), or the broker's ACL"
    return "[mqtt] topic_prefix, or the broker's ACL"


# 3.1.1 CONNACK return codes as plain ints (older paho paths): as their MQTT 5 equivalents.
_V311_REFUSALS: Final = {2: 0x85, 4: 0x86, 5: 0x87}
