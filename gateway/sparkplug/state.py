"""The host application's STATE (Sparkplug 3.0): on ``spBv1.0/STATE/{host_id}``, retained,
QoS 1, the JSON ``{"online": true, "timestamp": t}`` after each connect, and the Will
``{"online": false, "timestamp": t}`` with the same ``t`` (the time of the CONNECT).

Its own MQTT connection, beside the ingest session whose Will is the node's native presence (a
connection has one Will). The link subscribes to its own STATE topic and publishes its birth
again whenever the retained STATE says offline with another timestamp than its own: with
several nodes sharing one host id, the Will of one that died does not leave the host offline
while another serves. A clean stop publishes the offline STATE before disconnecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aiomqtt
import structlog

from gateway.support.backoff import Backoff
from protocol import sparkplug

log = structlog.get_logger(__name__)

# Builds the link's client with the node's broker settings and the given Will.
ClientFactory = Callable[[aiomqtt.Will], aiomqtt.Client]


class HostStateLink:
    def __init__(self, *, host_id: str, client: ClientFactory, backoff: Backoff) -> None:
        self.topic = sparkplug.state_topic(host_id)
        self.client = client
        self.backoff = backoff
        self.online = False
        # The timestamp of this link's current birth (and Will).
        self.timestamp: int | None = None
        self.births = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.timestamp = timestamp = int(time.time() * 1000)
            will = aiomqtt.Will(
                self.topic, sparkplug.state_payload(False, timestamp), qos=1, retain=True
            )
            try:
                async with self.client(will) as client:
                    await self._serve(client, timestamp, stop)
                    return
            except aiomqtt.MqttError as exc:
                self.online = False
                delay = self.backoff.next_delay()
                log.warning(
                    "sparkplug_state_link_lost", error=repr(exc), retry_in_s=round(delay, 3)
                )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await stop.wait()

    async def _serve(self, client: aiomqtt.Client, timestamp: int, stop: asyncio.Event) -> None:
        # Subscribed first: the retained STATE read back is what tells whether to speak again.
        await client.subscribe(self.topic, qos=1)
        await self._birth(client, timestamp)
        self.backoff.reset()
        reader = asyncio.create_task(self._watch(client, timestamp))
        stopping = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait({reader, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                reader.result()  # the connection's error, if it ended with one
        finally:
            reader.cancel()
            stopping.cancel()
            await asyncio.gather(reader, stopping, return_exceptions=True)
        if stop.is_set():
            # A clean stop: say so before the disconnect (which would not send the Will).
            await client.publish(
                self.topic, sparkplug.state_payload(False, timestamp), qos=1, retain=True
            )
            self.online = False
            log.info("sparkplug_state_offline", topic=self.topic)

    async def _birth(self, client: aiomqtt.Client, timestamp: int) -> None:
        await client.publish(
            self.topic, sparkplug.state_payload(True, timestamp), qos=1, retain=True
        )
        self.online = True
        self.births += 1
        log.info("sparkplug_state_online", topic=self.topic, timestamp=timestamp)

    async def _watch(self, client: aiomqtt.Client, timestamp: int) -> None:
        async for message in client.messages:
            state = sparkplug.parse_state(bytes(message.payload))
            if state is None:
                continue
            online, at = state
            if not online and at != timestamp:
                # Another session's Will (a node of ours that died, or our own earlier one)
                # says the host is gone while this link serves it.
                await self._birth(client, timestamp)
