"""The broker connection loop: connect, subscribe, read into the pipeline, reconnect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import aiomqtt
import structlog

from gateway.backoff import Backoff
from gateway.ingest import Inbound, IngestWriter
from gateway.metrics import Metrics
from gateway.mqtt import AckingClient, ConnectionSettings

log = structlog.get_logger("gateway.mqtt")

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

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            client = AckingClient(self.settings)
            try:
                async with client:
                    await self._serve(client, stop)
                    return
            except aiomqtt.MqttError as exc:
                self.metrics.mqtt_connects.labels("error").inc()
                delay = self.backoff.next_delay()
                log.warning(
                    "broker_unavailable",
                    host=self.settings.host,
                    port=self.settings.port,
                    error=str(exc),
                    retry_in_s=round(delay, 3),
                )
            finally:
                self._set_connected(False)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await stop.wait()

    async def _serve(self, client: AckingClient, stop: asyncio.Event) -> None:
        self.connections += 1
        self.metrics.mqtt_connects.labels("ok").inc()
        for topic in self.subscriptions:
            await client.subscribe(topic, qos=1)
        await client.publish(self.presence_topic, ONLINE, qos=1, retain=True)
        self.backoff.reset()
        self._set_connected(True)
        log.info(
            "broker_connected",
            host=self.settings.host,
            port=self.settings.port,
            client_id=self.settings.client_id,
            subscriptions=list(self.subscriptions),
        )
        if self.on_connected is not None:
            self.on_connected()
        await self._read_until_stop(client, stop)
        drained = await self.writer.drain(self.drain_timeout_s)
        if not drained:
            log.warning(
                "drain_timeout",
                pending=self.writer.queue.qsize(),
                note="unacknowledged messages will be redelivered by the broker",
            )
        await client.publish(self.presence_topic, OFFLINE, qos=1, retain=True)
        log.info("broker_disconnecting", drained=drained)

    async def _read_until_stop(self, client: AckingClient, stop: asyncio.Event) -> None:
        """Return when stop is set; raise MqttError when the connection drops."""
        reader = asyncio.create_task(self._read(client), name="mqtt-reader")
        stopper = asyncio.create_task(stop.wait(), name="mqtt-stop")
        try:
            await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, stopper):
                task.cancel()
            await asyncio.gather(reader, stopper, return_exceptions=True)
        if not stop.is_set():
            reader.result()  # re-raises the disconnect
            raise aiomqtt.MqttError("message stream ended")

    async def _read(self, client: AckingClient) -> None:
        loop = asyncio.get_running_loop()
        writer = self.writer
        async for message in client.messages:
            payload = message.payload
            assert isinstance(payload, bytes | bytearray)  # paho delivers bytes
            await writer.put(
                Inbound(
                    topic=message.topic.value,
                    payload=bytes(payload),
                    received_at=loop.time(),
                    acker=client,
                    message=message,
                )
            )

    def _set_connected(self, connected: bool) -> None:
        self.connected = connected
        self.metrics.mqtt_connected.set(1 if connected else 0)
