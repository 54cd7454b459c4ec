"""The broker connection loop: connect, subscribe, read into the pipeline, reconnect."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiomqtt
import structlog
from paho.mqtt.reasoncodes import ReasonCode

from gateway.config import endpoint_label
from gateway.domain.errors import StartupError
from gateway.ingest.decoder import Inbound
from gateway.ingest.writer import IngestWriter
from gateway.mqtt.capabilities import (
    CAPABLE_BROKER_SETTING,
    PROTOCOL_SETTING,
    BrokerCapabilities,
    Incapable,
    incapable,
    speaks_mqtt311,
)
from gateway.mqtt.memory import SubscriptionMemory
from gateway.mqtt.metrics import MqttMetrics
from gateway.mqtt.v5_connection import (
    UNSUPPORTED_PROTOCOL_VERSION,
    Mqtt5Connection,
    MqttConnectError,
    MqttNoConnAckError,
)
from gateway.mqtt.v311_client import ConnectionSettings, SubscriptionRefusedError
from gateway.mqtt.v311_connection import Mqtt311Connection
from gateway.mqtt.witness import closes_subscribing
from gateway.support.backoff import Backoff
from gateway.support.hearing import HEAR_WAIT_S, Hearing, Listening
from gateway.support.metrics import Metrics
from gateway.support.publish_refusal import PublishRefused
from protocol.topics import unshared

# Both protocols speak through our own client (parsing is the hot path): MQTT 5 on the mqtt5
# codec, MQTT 3.1.1 (the embedded amqtt broker's only version) on a hand-written codec over the
# same machinery (Mqtt311Connection is an Mqtt5Connection with another codec; issue 27).
BrokerConnection = Mqtt5Connection

log = structlog.get_logger(__name__)

BROKER_SETTING: Final = "[mqtt] host, [mqtt] port"
ENDPOINTS_SETTING: Final = "[mqtt] hosts"
_CREDENTIALS: Final = "[mqtt] username, [mqtt] password (or GATEWAY_MQTT_PASSWORD)"
# CONNACK reason codes (MQTT 5; paho maps 3.1.1's return codes 2, 4, 5 onto them) that no
# retry can change: the setting to fix for each.
_REFUSALS: Final = {
    0x85: "[mqtt] client_id",  # client identifier not valid
    0x86: _CREDENTIALS,  # bad user name or password
    0x87: _CREDENTIALS,  # not authorized
    0x8A: _CREDENTIALS,  # banned
    0x8C: _CREDENTIALS,  # bad authentication method
    UNSUPPORTED_PROTOCOL_VERSION: PROTOCOL_SETTING,  # 0x84; 3.1.1's return code 1 too
    0x9A: CAPABLE_BROKER_SETTING,  # retain not supported (the Will, our presence, is retained)
    0x9B: CAPABLE_BROKER_SETTING,  # QoS not supported (the Will is QoS 1: a QoS-0-only broker)
}
# What those refusals mean for the gateway, said in the one line.
_REFUSAL_MEANS: Final = {
    UNSUPPORTED_PROTOCOL_VERSION: "the broker does not speak this MQTT version",
    0x9A: "the broker has no retained messages, which the gateway's presence needs",
    0x9B: "the broker does not carry QoS 1, which the gateway needs to store every message",
}
_TAKEN_OVER: Final = 0x8E  # DISCONNECT: Session taken over
TAKEOVER_SETTING: Final = (
    "[node] id (or [mqtt] client_id): another client connected with this client id"
)
# A connection that lived this long after its CONNACK resets the reconnect backoff; shorter
# ones ended by the broker, twice in a row, are taken for a client-id clash (MQTT 3.1.1
# cannot say it, and mosquitto 2.0 does not say it to MQTT 5 clients either).
STABLE_S: Final = 10.0
_SHORT_LIVED_IN_A_ROW: Final = 2

# The probe: a message of this mark, published on a topic each filter must
# match, proves the subscription delivers. Any message so marked is acknowledged and dropped
# by every node's reader: it never becomes telemetry, a receipt or a dead letter.
PROBE_MARK: Final = b"\x00gateway-probe\x00"
PROBE_DEVICE: Final = "gateway-probe"
# A shared filter's probe may be delivered to another member of the group: sent again this
# often until one comes back.
PROBE_REPEAT_S: Final = 1.0
# Probes a round for a shared filter: the broker hands each to the next node of the group, so
# with up to this many nodes one comes back in the first round.
PROBE_SHARE_COPIES: Final = 4

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
        probe_timeout_s: float = 0.0,
        memory: SubscriptionMemory | None = None,
        resubscribe_stale: bool = False,
        endpoints: Sequence[tuple[str, int]] = (),
        broker_setting: str = BROKER_SETTING,
    ) -> None:
        self.settings = settings
        # What an unreachable broker's log line names ([mqtt] hosts when configured).
        self.broker_setting = broker_setting
        # The broker's endpoints ([mqtt] hosts), tried in turn from the first: a failed
        # connect or a lost connection moves to the next at once; the reconnect backoff is
        # waited once a whole round of them failed (see _next_delay). One by default: the
        # settings' own.
        self.endpoints: tuple[tuple[str, int], ...] = tuple(endpoints) or (
            (settings.host, settings.port),
        )
        self._index = 0
        # Attempts that failed in a row in this round over the endpoints.
        self._failed_in_round = 0
        # The endpoint of the last session established, and the last error seen at each
        # endpoint (what the one line of an endpoint switch says).
        self._home: tuple[str, int] | None = None
        self._last_error: dict[tuple[str, int], str] = {}
        # Endpoints that refused the connection before any was made (all of them: exit 2).
        self._refused_at_start: set[tuple[str, int]] = set()
        self.subscriptions = tuple(subscriptions)
        self.presence_topic = presence_topic
        self.writer = writer
        self.metrics = metrics
        self.mqtt_metrics = MqttMetrics.of(metrics.registry)
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
        # Set while ``subscribed``: what waits for the subscriptions (the Sparkplug host's
        # STATE birth, which edge nodes answer at once with their births) waits on it.
        self._subscribed_now = asyncio.Event()
        # Set (and replaced by a new one) each time the session goes to another broker than
        # its connection's before: what follows the session's broker (the Sparkplug STATE
        # link) waits on it (moved_from).
        self._broker_moved = asyncio.Event()
        # Every break of the subscriptions, the first from before the process (nothing was
        # listened to before the first subscribe): what the inactivity monitor hears.
        self.listening = Listening()
        self.client: BrokerConnection | None = None
        # The bound our publishes keep to, besides the broker's CONNACK: [mqtt] max_packet_size,
        # lowered for good when the broker disconnects us for a packet too large (0x95), so
        # that no message drops the connection twice (gateway.mqtt.v5_connection).
        self.max_packet_size: int | None = settings.max_packet_size or None
        # MQTT 3.1.1: how long a probe may take to come back (0: no probe).
        self.probe_timeout_s = probe_timeout_s
        self.memory = memory
        # Subscribe a stale filter again before removing it ([mqtt] broker_family = "rabbitmq").
        self.resubscribe_stale = resubscribe_stale
        # What the broker said at the last connect (logged once, at the first).
        self.capabilities: BrokerCapabilities | None = None
        # Why the broker will not serve us as configured (None: nothing known); /health's 503.
        self.problem: str | None = None
        self._connected_at: float | None = None
        self._short_lived = 0
        # When a probe first came back unproven before any session was established (loop time),
        # and the writer's progress then (stored messages since restart the budget).
        self._unproven_since: float | None = None
        self._unproven_progress = 0.0
        # Connections in a row lost while subscribing (before every SUBACK came).
        self._lost_subscribing = 0
        # Probe payloads not yet back, and the moment anything last arrived.
        self._probes: set[bytes] = set()
        self._probe_back = asyncio.Event()
        self._last_delivery = 0.0
        # A reload that changed the filters ([mqtt] topic_prefix, shared_group): what to
        # connect with next, set while the current connection is ended cleanly.
        self._next: Reconfiguration | None = None
        self._remake = asyncio.Event()
        # The filters this process proved with the probe, by endpoint (see _proven_before):
        # proven on one broker says nothing of another's session.
        self._proven: dict[tuple[str, int], frozenset[str]] = {}
        self._show_endpoint()

    def reconfigure(
        self,
        *,
        subscriptions: Sequence[str],
        settings: ConnectionSettings,
        presence_topic: str,
        apply: Callable[[], None],
        endpoints: Sequence[tuple[str, int]] | None = None,
    ) -> bool:
        """Follow a reload that changed the filters or the presence topic (``[mqtt]
        topic_prefix``, ``shared_group``): the connection is ended as at a stop (reading
        stops, what was read is stored and acknowledged) and made again at once with the new
        filters; ``apply`` runs between the two connections, when no message of the old
        configuration is in the pipeline. At that connect the old filters are unsubscribed
        (they are remembered as stale) and the new ones are proven as at a start.

        A changed endpoint list (``[mqtt] hosts``) is followed too: while it still holds the
        endpoint in use, the connection stays and the next switch takes the new list; without
        it, the connection is ended as above and made on the new list's first endpoint (and
        ``apply`` runs at once when the connection stays). Returns whether there was anything
        to change: if so, ``apply`` has run or runs between the connections."""
        wanted = self.endpoints if endpoints is None else tuple(endpoints)
        if self._next is not None:
            # A reload's reconnection is still to be made: this reload replaces it whole,
            # even one back to the filters in use (else the earlier reload's filters and
            # ``apply`` would be taken at that reconnection, over this one's).
            self._next = Reconfiguration(
                tuple(subscriptions), settings, presence_topic, apply, wanted
            )
            self._remake.set()
            return True
        topics_same = (
            tuple(subscriptions) == self.subscriptions and presence_topic == self.presence_topic
        )
        if topics_same and self.endpoint in wanted:
            # What the session runs: a move an earlier reload asked for, not made yet, is
            # called off (the last reload wins; it used to be made all the same, to the
            # topics the file no longer named). A remake it asked for already ends the
            # connection, which is then made again as it was.
            self._next = None
            if wanted == self.endpoints:
                return False
            self._set_endpoints(wanted)
            # No connection is made again, so nothing runs ``apply`` later: what the reload
            # changed beside the filters (the mappings a reload keeping their topics changed)
            # takes effect now, as it would with neither filters nor endpoints changed.
            apply()
            return True
        self._next = Reconfiguration(tuple(subscriptions), settings, presence_topic, apply, wanted)
        self._remake.set()
        if topics_same:
            log.info(
                "mqtt_endpoints_changing",
                endpoint=endpoint_label(*self.endpoint),
                configured=[endpoint_label(*e) for e in wanted],
                note="the endpoint in use is no longer configured: the connection is made"
                " again on the new list",
            )
        else:
            log.info(
                "mqtt_subscriptions_changing",
                subscribed=list(self.subscriptions),
                configured=list(subscriptions),
                note="the broker connection is made again with the new filters",
            )
        return True

    @property
    def endpoint(self) -> tuple[str, int]:
        """The endpoint in use: connected to, or the next to try."""
        return self.endpoints[self._index]

    def _set_endpoints(self, endpoints: tuple[tuple[str, int], ...]) -> None:
        """A new endpoint list: the one in use is kept when it is in it, else the first."""
        current = self.endpoint
        old = self.endpoints
        self.endpoints = endpoints
        self._index = endpoints.index(current) if current in endpoints else 0
        self._failed_in_round = 0
        self._refused_at_start.clear()
        self.mqtt_metrics.mqtt_endpoint.clear()
        self._show_endpoint()
        log.info(
            "mqtt_endpoints_changed",
            endpoints=[endpoint_label(*e) for e in endpoints],
            previous=[endpoint_label(*e) for e in old],
            endpoint=endpoint_label(*self.endpoint),
        )

    def _show_endpoint(self) -> None:
        """``gateway_mqtt_endpoint``: 1 for the endpoint connected to, 0 for the others."""
        gauge = self.mqtt_metrics.mqtt_endpoint
        for index, endpoint in enumerate(self.endpoints):
            up = self.connected and index == self._index
            gauge.labels(endpoint_label(*endpoint)).set(1 if up else 0)

    def _take_reconfiguration(self) -> None:
        """Between two connections: what a reload asked for becomes the session's."""
        change, self._next = self._next, None
        self._remake.clear()
        if change is None:
            return
        self.subscriptions = change.subscriptions
        self.settings = change.settings
        self.presence_topic = change.presence_topic
        if change.endpoints != self.endpoints:
            self._set_endpoints(change.endpoints)
        change.apply()
        log.info("mqtt_subscriptions_changed", subscriptions=list(self.subscriptions))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._take_reconfiguration()
            host, port = self.endpoint
            if (self.settings.host, self.settings.port) != (host, port):
                self.settings = dataclasses.replace(self.settings, host=host, port=port)
                self._broker_moved.set()
                self._broker_moved = asyncio.Event()
            client = self.client = self._connection()
            self._connected_at = None
            delay = 0.0
            failure: BaseException | None = None
            try:
                async with client:
                    await self._serve(client, stop)
                    if stop.is_set() or not self._remake.is_set():
                        return
            except (SubscriptionRefusedError, SubscriptionUnprovenError) as exc:
                failure = exc
                delay = self._subscription_failed(exc)
            except BrokerIncapableError as exc:
                failure = exc
                delay = self._incapable(exc)
            except aiomqtt.MqttError as exc:
                failure = exc
                delay = await self._connection_failed(exc)
            finally:
                self._set_connected(False)
                self._learn_packet_limit(client)
            if failure is not None:
                self._move_on(failure)
            if delay > 0 and not self._remake.is_set():
                await self._pause(stop, delay)

    def _move_on(self, failure: BaseException) -> None:
        """After a failed connect or a lost connection: the next endpoint (with one)."""
        endpoint = self.endpoint
        self._last_error[endpoint] = str(failure) or type(failure).__name__
        if len(self.endpoints) > 1:
            self._index = (self._index + 1) % len(self.endpoints)
            self._show_endpoint()

    def _next_delay(self) -> float:
        """The wait before the next attempt: none while endpoints of this round are left to
        try (a dead first endpoint costs the second no backoff), the backoff's next delay
        once every endpoint failed in a row."""
        self._failed_in_round += 1
        if self._failed_in_round < len(self.endpoints):
            return 0.0
        self._failed_in_round = 0
        return self.backoff.next_delay()

    async def _pause(self, stop: asyncio.Event, delay: float) -> None:
        """The backoff before the next attempt, cut short by a stop or by a reload that
        changed the filters (the next attempt may be the one that works)."""
        waits = [
            asyncio.create_task(stop.wait(), name="mqtt-stop"),
            asyncio.create_task(self._remake.wait(), name="mqtt-remake"),
        ]
        try:
            await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    @property
    def _where(self) -> str:
        return endpoint_label(self.settings.host, self.settings.port)

    def _subscription_failed(
        self, exc: SubscriptionRefusedError | SubscriptionUnprovenError
    ) -> float:
        self.mqtt_metrics.mqtt_connects.labels("error").inc()
        setting = _subscription_setting(exc.topic)
        if isinstance(exc, SubscriptionRefusedError):
            what = (
                f"the broker at {self._where} refused the subscription {exc.topic!r}: "
                f"{exc.reason} (reason code {exc.reason_code})"
            )
        else:
            what = f"the broker at {self._where} {exc}"
        if self.established == 0 and isinstance(exc, SubscriptionUnprovenError):
            # Delivered nothing: a configuration (an ACL, a literal `$share/...`), or a resumed
            # session whose broker holds deliveries back (NATS keeps a crashed session's
            # unacknowledged messages pending for its ack_wait, 30 s, and delivers nothing
            # else meanwhile). Probed again for PROBE_START_TRIES probe timeouts, then final.
            now = asyncio.get_running_loop().time()
            progress = self.writer.last_progress
            if self._unproven_since is None or progress > self._unproven_progress:
                # First time, or messages were stored since: the broker delivers (a backlog
                # first), so the budget starts again.
                self._unproven_since = now
                self._unproven_progress = progress
            if now - self._unproven_since < PROBE_START_TRIES * self.probe_timeout_s:
                delay = self._next_delay()
                self.problem = f"{what} ({setting}); probing again"
                log.warning(
                    "subscription_unproven",
                    topic=exc.topic,
                    error=what,
                    retry_in_s=round(delay, 3),
                    setting=setting,
                )
                return delay
        if self.established == 0:
            # The broker takes the connection but not the subscription (an ACL, shared
            # subscriptions not supported or not allowed), or takes it and delivers nothing.
            # Retrying changes nothing, and a node that cannot subscribe cannot ingest: final.
            raise StartupError(what, setting=setting, configuration=True) from None
        # Refused after it was once accepted (the broker's ACL changed): say so, and wait for
        # it to be allowed again, as for a CONNACK refused later on.
        delay = self._after_loss()
        self.problem = f"{what} ({setting})"
        log.error(
            "subscription_refused",
            host=self.settings.host,
            port=self.settings.port,
            topic=exc.topic,
            reason_code=getattr(exc, "reason_code", None),
            error=what,
            retry_in_s=round(delay, 3),
            setting=setting,
        )
        return delay

    def _incapable(self, exc: BrokerIncapableError) -> float:
        self.mqtt_metrics.mqtt_connects.labels("error").inc()
        what = f"the broker at {self._where} cannot serve this configuration: {exc.why.reason}"
        if self.established == 0:
            raise StartupError(what, setting=exc.why.setting, configuration=True) from None
        delay = self._after_loss()
        self.problem = f"{what} ({exc.why.setting})"
        log.error(
            "broker_incapable", error=what, setting=exc.why.setting, retry_in_s=round(delay, 3)
        )
        return delay

    async def _connection_failed(self, exc: aiomqtt.MqttError) -> float:
        self.mqtt_metrics.mqtt_connects.labels("error").inc()
        refused = _refusal(exc)
        if refused is not None and self.connections == 0:
            self._refused_at_start.add(self.endpoint)
        if (
            refused is not None
            and self.connections == 0
            and len(self._refused_at_start) >= len(self.endpoints)
        ):
            # Never connected yet, and every endpoint refused: the broker will refuse these
            # settings however long we retry. (Refused later, say after a password rotation,
            # we wait; refused by one endpoint of several, the next is tried.)
            code, setting = refused
            means = f"; {_REFUSAL_MEANS[code]}" if code in _REFUSAL_MEANS else ""
            raise StartupError(
                f"the broker at {self._where} refused the connection: {exc} (reason code {code})"
                f"{means}",
                setting=setting,
                configuration=True,
            ) from None
        if (
            self.connections == 0
            and self.settings.protocol == "5"  # on 3.1.1 already: nothing to suggest
            and isinstance(exc, MqttNoConnAckError)
            and await speaks_mqtt311(self.settings)
        ):
            # A refusal as final as a CONNACK's, and like one it ends a start only once every
            # endpoint refused: the next of [mqtt] hosts may well speak MQTT 5.
            self._refused_at_start.add(self.endpoint)
            if len(self._refused_at_start) >= len(self.endpoints):
                raise StartupError(
                    f"the broker at {self._where} answers an MQTT 3.1.1 CONNECT but not an"
                    f" MQTT 5 one ({exc}): it does not speak MQTT 5",
                    setting=PROTOCOL_SETTING,
                    configuration=True,
                ) from None
            refused = (UNSUPPORTED_PROTOCOL_VERSION, PROTOCOL_SETTING)
        if self._lost_subscribing >= LOST_SUBSCRIBING_LIMIT and await self._closes_subscribing():
            what = (
                f"the broker at {self._where} closed the connection each time the gateway "
                f"subscribed ({self._lost_subscribing} times in a row: {exc}); RabbitMQ does so "
                "for a subscription its permissions deny"
            )
            if self.established == 0:
                raise StartupError(what, setting=ACL_SETTING, configuration=True) from None
            delay = self._after_loss()
            self.problem = f"{what} ({ACL_SETTING})"
            log.error(
                "subscription_refused", error=what, retry_in_s=round(delay, 3), setting=ACL_SETTING
            )
            return delay
        delay = self._after_loss()
        if self._taken_over(exc):
            self.problem = (
                f"the broker at {self._where} disconnected client id "
                f"{self.settings.client_id!r}: another client connected with it "
                f"({TAKEOVER_SETTING})"
            )
            log.error(
                "client_id_taken_over",
                host=self.settings.host,
                port=self.settings.port,
                client_id=self.settings.client_id,
                error=str(exc),
                # MQTT 5 says so (0x8E); on 3.1.1 it is inferred from short-lived sessions.
                certain=getattr(exc, "reason_code", None) == _TAKEN_OVER,
                retry_in_s=round(delay, 3),
                setting=TAKEOVER_SETTING,
            )
            return delay
        if refused is not None:
            self.problem = f"the broker at {self._where} refused the connection: {exc}"
        log.warning(
            "broker_unavailable",
            host=self.settings.host,
            port=self.settings.port,
            error=str(exc),
            retry_in_s=round(delay, 3),
            setting=self.broker_setting if refused is None else refused[1],
            **(_hint(exc) if self.settings.protocol == "5" else {}),
        )
        return delay

    async def _closes_subscribing(self) -> bool:
        """After connections lost while subscribing, LOST_SUBSCRIBING_LIMIT in a row: whether
        the broker closes a connection for subscribing (RabbitMQ's answer to a denied
        subscription). A witness under another client id subscribes as the gateway did; if the
        broker lets it, the losses were not the subscription's (another client with our client
        id took the connections over while they subscribed: two nodes started with one id) and
        the count starts again. When the witness cannot tell, the losses name the ACL as
        before."""
        probe = None
        if self.probe_timeout_s > 0 and self.subscriptions:
            mark = f"{self.settings.client_id}/witness/{secrets.token_hex(6)}".encode()
            probe = (_probe_topic(self.subscriptions[0]), PROBE_MARK + mark)
        closes = await closes_subscribing(self.settings, self.subscriptions, probe)
        if closes is not False:
            return True
        log.info(
            "subscription_not_refused",
            lost_subscribing=self._lost_subscribing,
            note="the broker let another client id subscribe with these credentials: the lost"
            " connections were not the subscription's",
        )
        self._lost_subscribing = 0
        return False

    def _after_loss(self) -> float:
        """The delay before the next attempt. Only a connection that lived STABLE_S starts the
        backoff over: one taken over (another client with our id) or dropped at once must not
        make us reconnect in a tight loop."""
        connected_at = self._connected_at
        if connected_at is not None:
            if asyncio.get_running_loop().time() - connected_at >= STABLE_S:
                self.backoff.reset()
                self._short_lived = 0
            else:
                self._short_lived += 1
        return self._next_delay()

    def _taken_over(self, exc: aiomqtt.MqttError) -> bool:
        """MQTT 5 may say it (DISCONNECT 0x8E); mosquitto 2.0 and MQTT 3.1.1 just close the
        connection, so connections closed by the broker soon after their CONNACK, twice in a
        row, are taken for it."""
        if getattr(exc, "reason_code", None) == _TAKEN_OVER:
            return True
        return self._connected_at is not None and self._short_lived >= _SHORT_LIVED_IN_A_ROW

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
        return Mqtt311Connection(
            settings,
            buffer_high_bytes=settings.buffer_high_bytes,
            on_pause=self._paused,
            max_packet_size=self.max_packet_size,
        )

    async def _serve(self, client: BrokerConnection, stop: asyncio.Event) -> None:
        self.connections += 1
        self._connected_at = asyncio.get_running_loop().time()
        self.mqtt_metrics.mqtt_connects.labels("ok").inc()
        self._learn(client)
        self._set_connected(True)
        # Read from the first moment: a resumed session delivers its backlog right after
        # CONNACK, and the SUBACK queues behind it. Not reading would stall the subscribe.
        reader = asyncio.create_task(self._read(client), name="mqtt-reader")
        try:
            setup = asyncio.create_task(self._subscribe(client), name="mqtt-subscribe")
            try:
                ready = await self._until(setup, reader, client, stop)
            except (SubscriptionRefusedError, SubscriptionUnprovenError):
                raise
            except aiomqtt.MqttError:
                # Lost while subscribing: RabbitMQ closes the connection on a subscription
                # its permissions deny, instead of answering SUBACK 0x80.
                self._lost_subscribing += 1
                raise
            if ready:
                self._lost_subscribing = 0
                self.established += 1
                self.subscribed = True
                self._subscribed_now.set()
                self.listening.subscribed()
                self.problem = None
                self._arrived()
                log.info(
                    "broker_connected",
                    host=self.settings.host,
                    port=self.settings.port,
                    client_id=self.settings.client_id,
                    subscriptions=list(self.subscriptions),
                )
                if self.on_connected is not None:
                    self.on_connected()
                await self._until(None, reader, client, stop)
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
        change = self._next if self._remake.is_set() else None
        if (
            change is None
            or change.presence_topic != self.presence_topic
            or self.endpoint not in change.endpoints
        ):
            # (Made again for a reload under the same presence topic on the same broker: the
            # node stays online. Leaving an endpoint, it is left offline there.)
            await client.publish(self.presence_topic, OFFLINE, qos=1, retain=self._retain())
        log.info("broker_disconnecting", drained=drained)

    def _arrived(self) -> None:
        """A session established on the endpoint in use: the round over the endpoints starts
        again from here, and a move from the endpoint of the last session (at start: the
        first configured) is said in one line, with why the gateway left it."""
        self._failed_in_round = 0
        self._refused_at_start.clear()
        endpoint = self.endpoint
        home = self._home if self._home is not None else self.endpoints[0]
        self._home = endpoint
        if endpoint == home:
            return
        # Short-lived connections in a row say "taken over" on one broker, not across two.
        self._short_lived = 0
        self.mqtt_metrics.endpoint_switches.inc()
        log.warning(
            "broker_endpoint_switched",
            endpoint=endpoint_label(*endpoint),
            previous=endpoint_label(*home),
            reason=self._last_error.get(home, "not tried"),
            session_present=self.capabilities.session_present if self.capabilities else None,
        )

    def _learn(self, client: BrokerConnection) -> None:
        """What the broker can do: logged at the first connect; refused when the
        configuration needs what it lacks (raises BrokerIncapableError)."""
        caps = client.capabilities  # on MQTT 3.1.1: the protocol, nothing else
        first = self.capabilities is None
        self.capabilities = caps
        if first:
            log.info(
                "broker_capabilities",
                host=self.settings.host,
                port=self.settings.port,
                **caps.fields(),
                probe=f"{self.probe_timeout_s}s" if self.probe_timeout_s > 0 else "off",
            )
        why = incapable(caps, self.subscriptions)
        if why is not None:
            raise BrokerIncapableError(why)

    def _retain(self) -> bool:
        return self.capabilities is None or self.capabilities.retain is not False

    async def _subscribe(self, client: BrokerConnection) -> None:
        # No call timeout: behind a large backlog the SUBACK may take as long as the backlog
        # takes to drain. A dead connection ends the reader instead, which _until watches.
        remembered = None
        if self.memory is not None:
            # Per endpoint: a standalone broker's session holds what was subscribed there.
            self.memory.broker = f"{self.settings.host}:{self.settings.port}"
            # Before subscribing: a crash between the two must not leave a filter unknown.
            remembered = await self.memory.remember(self.subscriptions)
        for topic in self.subscriptions:
            await client.subscribe(topic, qos=1, wait_s=math.inf)
        if remembered is not None:
            await self._unsubscribe_stale(client, remembered)
        if self.probe_timeout_s > 0 and not self._proven_before(client, remembered):
            try:
                proven = await self._probe(client)
            except SubscriptionUnprovenError:
                if self.memory is not None:  # the next process must probe again too
                    await self.memory.prove(self.subscriptions, proven=False)
                raise
            self._proven[self.endpoint] = frozenset(self.subscriptions)
            if proven and self.memory is not None:
                await self.memory.prove(self.subscriptions, proven=True)
        await client.publish(
            self.presence_topic, ONLINE, qos=1, retain=self._retain(), wait_s=math.inf
        )

    def _proven_before(self, client: BrokerConnection, remembered: dict[str, bool] | None) -> bool:
        """A resumed session (either protocol version) holding exactly the configured
        filters, proven on this broker: by this process, or by an earlier one as the database
        records it (migration 0038). Probing again would wait behind the backlog the session
        resumes with: on MQTT 3.1.1, whose broker may send a whole queued backlog at once
        (mosquitto past its inflight window), the node reported itself starting until all of
        it was delivered. Never after a probe of this process came back unproven, nor for a
        filter whose last probe did (it is recorded unproven, so the next process probes)."""
        if not client.session_present:
            return False
        wanted = frozenset(self.subscriptions)
        if remembered is None or remembered.keys() != wanted:
            return False
        if self._unproven_since is not None:
            return False
        # Proven on this endpoint: a probe that came back through another broker proves
        # nothing of this one's session (a standalone broker holds its own; the record is
        # per broker too).
        return self._proven.get(self.endpoint) == wanted or all(remembered.values())

    async def _unsubscribe_stale(
        self, client: BrokerConnection, remembered: dict[str, bool]
    ) -> None:
        """Remove from the persistent session what an earlier configuration subscribed to."""
        stale = sorted(remembered.keys() - set(self.subscriptions))
        if not stale or self.memory is None:
            return
        for topic in stale:
            if self.resubscribe_stale:
                # RabbitMQ (3.10) acknowledges the UNSUBSCRIBE of a filter an earlier connection
                # made and keeps its binding; made again on this connection, it goes.
                with contextlib.suppress(SubscriptionRefusedError):
                    await client.subscribe(topic, qos=1, wait_s=math.inf)
            await client.unsubscribe(topic, wait_s=math.inf)
        await self.memory.forget(stale)
        log.info(
            "stale_subscriptions_removed",
            topics=stale,
            client_id=self.settings.client_id,
            note="subscribed under an earlier configuration",
        )

    async def _probe(self, client: BrokerConnection) -> bool:
        """Prove each subscription delivers: publish a marked message on a topic the filter
        must match and require it back before ``probe_timeout_s`` pass without anything
        arriving (a backlog delivered first keeps the wait going). MQTT 3.1.1 cannot say
        whether a subscription works; neither can MQTT 5 when the broker grants the
        SUBSCRIBE and filters at delivery (mosquitto's ``acl_file``). A shared filter gets
        ``PROBE_SHARE_COPIES`` probes a round (the broker hands them round the group; one back
        proves it), repeated every ``PROBE_REPEAT_S``. True when every probe came back; False
        when the broker refused a probe itself (nothing proven, nothing held against the
        filters). Raises SubscriptionUnprovenError naming the first filter that delivered
        nothing."""
        loop = asyncio.get_running_loop()
        nonce = secrets.token_hex(6)
        owed: dict[str, list[bytes]] = {}
        for index, topic in enumerate(self.subscriptions):
            copies = PROBE_SHARE_COPIES if topic.startswith("$share/") else 1
            owed[topic] = [
                PROBE_MARK + f"{self.settings.client_id}/{nonce}/{index}/{copy}".encode()
                for copy in range(copies)
            ]
        self._probes = {payload for payloads in owed.values() for payload in payloads}
        self._last_delivery = started = loop.time()
        sent: dict[str, float] = {}
        try:
            while owed:
                now = loop.time()
                for topic, payloads in owed.items():
                    last = sent.get(topic)
                    if last is None or (
                        topic.startswith("$share/") and now - last >= PROBE_REPEAT_S
                    ):
                        sent[topic] = now
                        for payload in payloads:
                            if not await self._publish_probe(client, topic, payload):
                                return False
                quiet_since = max(started, self._last_delivery, self.writer.last_progress)
                left = quiet_since + self.probe_timeout_s - loop.time()
                if left <= 0:
                    topic = next(iter(owed))  # the first in subscription order
                    raise SubscriptionUnprovenError(
                        topic, _probe_topic(topic), self.probe_timeout_s
                    )
                self._probe_back.clear()
                try:
                    async with asyncio.timeout(min(left, PROBE_REPEAT_S)):
                        await self._probe_back.wait()
                except TimeoutError:
                    pass
                for topic in [
                    t for t, payloads in owed.items() if not self._probes.issuperset(payloads)
                ]:
                    self._probes.difference_update(owed.pop(topic))
        finally:
            self._probes = set()
        log.info("subscriptions_proven", topics=list(self.subscriptions), probe=PROBE_DEVICE)
        return True

    async def _publish_probe(self, client: BrokerConnection, topic: str, payload: bytes) -> bool:
        """False when the broker refused the probe itself (MQTT 5 says so in its PUBACK: an
        ACL that does not let the gateway publish there): the subscriptions cannot be proven
        then, which is said once per connect, and not held against them."""
        try:
            await client.publish(_probe_topic(topic), payload, qos=1, wait_s=math.inf)
        except PublishRefused as exc:
            log.warning(
                "probe_refused",
                topic=_probe_topic(topic),
                reason=exc.reason,
                reason_code=exc.reason_code,
                note="the subscriptions are not proven; let the gateway publish there, or set"
                " [mqtt] probe_timeout_s = 0",
            )
            return False
        return True

    def _probe_arrived(self, payload: bytes) -> None:
        probes = self._probes
        if payload in probes:
            probes.discard(payload)
            self._probe_back.set()

    async def _until(
        self,
        step: asyncio.Task[None] | None,
        reader: asyncio.Task[None],
        client: BrokerConnection,
        stop: asyncio.Event,
    ) -> bool:
        """Wait for ``step`` (None: forever) while the connection lives and no stop comes.

        True when the step finished; False when stop was set, or a reload asked for the
        connection to be made again; raises MqttError when the connection dropped (the reader
        ended, or the connection did while the reader was blocked handing a batch to a full
        queue: the writer stalled, PostgreSQL away).
        """
        stopper = asyncio.create_task(stop.wait(), name="mqtt-stop")
        remaker = asyncio.create_task(self._remake.wait(), name="mqtt-remake")
        waiting: set[asyncio.Future[Any]] = {reader, client.ended, stopper, remaker}
        if step is not None:
            waiting.add(step)
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            remaker.cancel()
            if step is not None and not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
        if step is not None and step.done() and not step.cancelled():
            step.result()  # re-raises a failed subscribe
            return True
        if stop.is_set() or self._remake.is_set():
            return False
        if reader.done():
            reader.result()  # re-raises the disconnect
        # Ended under a reader still handing over what it took (cancelled by the caller:
        # none of it was acknowledged, the broker delivers it again).
        raise client.error or aiomqtt.MqttError("message stream ended")

    async def _read(self, client: BrokerConnection) -> None:
        """Whatever arrived, up to a batch, handed over at once."""
        loop = asyncio.get_running_loop()
        writer = self.writer
        admit = writer.decoder.admit
        limit, queue = writer.batch_size, writer.queue
        while True:
            # Never more than the queue has room for: a full queue blocks the one message in
            # hand, and reading stops as before (the bound is the queue's, not the batch's).
            room = queue.maxsize - queue.qsize() if queue.maxsize > 0 else limit
            deliveries = await client.take(max(1, min(limit, room)))
            received_at = self._last_delivery = loop.time()
            items = []
            for delivery in deliveries:
                if delivery.payload.startswith(PROBE_MARK):
                    client.ack(delivery)  # a probe (ours, or another node's): never telemetry
                    self._probe_arrived(bytes(delivery.payload))
                    continue
                kept, size, sha256 = admit(delivery.payload, delivery.topic)
                if size is not None:
                    # Neither the delivery (kept for its PUBACK, which needs its packet id only)
                    # nor this frame may keep the whole oversized payload alive while it waits.
                    delivery.payload = kept
                items.append(
                    Inbound(delivery.topic, kept, received_at, client, delivery, size, sha256)
                )
            await writer.put_many(items)

    def _learn_packet_limit(self, client: BrokerConnection) -> None:
        learned = client.learned_max_packet_size
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
        if client is not None and client.is_open:
            limit = client.packet_limit
            return None if limit is None else limit[0]
        return self.max_packet_size

    def broker(self) -> tuple[str, int]:
        """The broker the session is connected to, or connects to next (host, port)."""
        return self.settings.host, self.settings.port

    async def moved_from(self, broker: tuple[str, int]) -> None:
        """Return once the session is at another broker than ``broker`` (its endpoint dead,
        or no longer listed after a reload)."""
        while self.broker() == broker:
            await self._broker_moved.wait()

    @property
    def subscribed_now(self) -> asyncio.Event:
        """Set while the session is connected and every subscription acknowledged (to wait
        on; only the session sets and clears it)."""
        return self._subscribed_now

    def _paused(self, bound: str) -> None:
        self.mqtt_metrics.read_pauses.labels(bound).inc()

    def hearing(self, keep_s: float) -> Hearing:
        """How long this node has been subscribed without a break (0 while it is not), and its
        breaks, from before its first subscribe on (those a silence of up to `keep_s` can
        need): a device's silence means something only while someone listened (inactivity
        rules). What the node received and has not stored yet is not heard yet: from the
        oldest such message's receipt on is a break too (the writer's lag). So is the time
        since the connection last carried anything: a link that stalls without closing is
        seen by the keep-alive only 1.5 intervals later, and until then every device whose
        reports the stall swallowed looked silent to a node that took itself for listening
        (``confirm_hearing`` first makes that time now on a live link)."""
        until = self.writer.unstored_since
        client = self.client
        if self.subscribed and client is not None:
            # (Also once the connection ended, until the session has seen it: the pass
            # waiting in confirm_hearing is woken by that end.)
            heard_at = client.heard_at
            until = heard_at if until is None else min(until, heard_at)
        return self.listening.hearing(keep_s, unstored_since=until)

    async def confirm_hearing(self) -> None:
        """Before silence is judged: ask the broker for an answer (a PINGREQ) and wait up to
        ``HEAR_WAIT_S`` for anything from it, so that ``hearing`` counts a live link as heard
        up to now and a stalled one only up to the stall."""
        client = self.client
        if self.subscribed and client is not None and client.is_open:
            await client.hear_again(HEAR_WAIT_S)

    def _set_connected(self, connected: bool) -> None:
        self.connected = connected
        if not connected:
            if self.subscribed:
                # From when the connection last carried anything (its close, when the
                # broker closed it): a stall ended by the keep-alive was no listening either.
                client = self.client
                self.listening.lost(None if client is None else client.heard_at)
            self.subscribed = False
            self._subscribed_now.clear()
        self.mqtt_metrics.mqtt_connected.set(1 if connected else 0)
        self._show_endpoint()


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


def _hint(exc: aiomqtt.MqttError) -> dict[str, str]:
    if isinstance(exc, MqttNoConnAckError):
        return {"hint": f"a broker speaking MQTT 3.1.1 only may never answer: {PROTOCOL_SETTING}"}
    return {}


# Connections in a row the broker closed while the gateway subscribed before the gateway asks a
# witness (gateway/mqtt/witness.py) and, when the broker closes the witness's subscription too,
# names the subscription (and its ACL) instead of the broker's address.
LOST_SUBSCRIBING_LIMIT: Final = 2
ACL_SETTING: Final = "[mqtt] topic_prefix, [mqtt] shared_group, or the broker's ACL"
# At start, a subscription that delivered no probe is probed again for this many probe
# timeouts before the node gives up (exit 2): 4 x 10 s outlasts NATS's 30 s ack_wait.
PROBE_START_TRIES: Final = 4


def _probe_topic(topic_filter: str) -> str:
    """A topic ``topic_filter`` must match (its $share prefix off, its wildcards filled)."""
    return "/".join(
        PROBE_DEVICE if level in ("+", "#") else level
        for level in unshared(topic_filter).split("/")
    )


class SubscriptionUnprovenError(aiomqtt.MqttError):
    """MQTT 3.1.1: the broker granted the subscription, and a probe published on a topic it
    must match did not come back."""

    def __init__(self, topic: str, probe_topic: str, timeout_s: float) -> None:
        shared = ""
        if topic.startswith("$share/"):
            shared = (
                "; a broker without shared subscriptions takes `$share/...` for a plain filter"
                " that no topic matches"
            )
        super().__init__(
            f"accepted the subscription {topic!r} but did not deliver the gateway's probe"
            f" published on {probe_topic!r} within {timeout_s:g}s{shared} (an ACL must let the"
            " gateway publish and read there; [mqtt] probe_timeout_s = 0 turns the probe off)"
        )
        self.topic = topic


class BrokerIncapableError(Exception):
    """The broker's CONNACK says it cannot do what the configuration needs."""

    def __init__(self, why: Incapable) -> None:
        super().__init__(why.reason)
        self.why = why


def _subscription_setting(topic: str) -> str:
    """What to change when the broker refuses ``topic``."""
    if topic.startswith("$share/"):
        return "[mqtt] shared_group (empty: no shared subscription), or the broker's ACL"
    return "[mqtt] topic_prefix, or the broker's ACL"


# 3.1.1 CONNACK return codes as plain ints (older paho paths): as their MQTT 5 equivalents.
_V311_REFUSALS: Final = {2: 0x85, 4: 0x86, 5: 0x87}


@dataclass(frozen=True, slots=True)
class Reconfiguration:
    """What a reload changed in the session (see :meth:`MqttSession.reconfigure`)."""

    subscriptions: tuple[str, ...]
    settings: ConnectionSettings
    presence_topic: str
    apply: Callable[[], None]
    endpoints: tuple[tuple[str, int], ...]
