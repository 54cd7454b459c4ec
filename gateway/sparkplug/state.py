"""The host application's STATE (Sparkplug 3.0): on ``spBv1.0/STATE/{host_id}``, retained,
QoS 1, the JSON ``{"online": true, "timestamp": t}`` after each connect, and the Will
``{"online": false, "timestamp": t}`` with the same ``t`` (the time of the CONNECT, or later:
below).

Its own MQTT connection, beside the ingest session whose Will is the node's native presence (a
connection has one Will). The link subscribes to its own STATE topic. An edge node following
Sparkplug 3.0 disconnects on an offline STATE whose timestamp is at least that of the online
one it accepted last, and accepts an online STATE only if its timestamp is at least the last
one's: so when an offline STATE from another session (a node of the same host id that stopped
or died, the one that connected last) is not older than this link's birth, the link connects
again, with a new Will and birth above the timestamp seen, and the host is online again for
them. Only such an offline STATE does it: another node's birth never does, and a reconnect
disconnects cleanly (no Will), so two nodes cannot keep each other reconnecting. A clean stop
publishes the offline STATE before disconnecting.

A timestamp never goes back: each connect's is above the highest STATE timestamp the link has
seen on the topic (retained or live) or published, whatever the clock says (NTP may step it
back), or edge nodes would ignore the birth. A higher offline STATE known only from the
retained one read after the connect (the process's first) is answered as above. The daemon's
clock is the database's as the node estimates it (gateway.support.db_clock), not the node's
own, which may be at 1970 after a power cut (no RTC, NTP not synced yet) that took the
broker's retained STATE with it: nothing retained to go above, the birth was older than the
one the edge nodes took last.

An offline STATE older than the link's birth (a node of the same host id that connected before
it, stopped or dead) changes nothing for the edge nodes connected, but it replaced the retained
STATE, which is all an edge node connecting later reads: the link publishes its birth again,
with the same timestamp, so that the retained STATE says online while a node serves.

The link serves from the broker the ingest session is at (``session``): when the session goes
to another (its broker dead, or no longer listed after a reload), the link says offline on the
broker it leaves (if it still lives) and connects where the session went.

Each birth waits for the node's ingest session to be subscribed (``ingest_subscribed``): an edge
node that has this host as its primary host answers the online STATE at once with its NBIRTH
and DBIRTHs, at QoS 0, which the broker gives to nobody while the session is still connecting
or subscribing (Sparkplug 3.0: the host subscribes, then publishes its birth).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import aiomqtt
import structlog

from gateway.support.backoff import Backoff
from protocol import sparkplug

log = structlog.get_logger(__name__)

# Builds the link's client with the node's broker settings and the given Will.
ClientFactory = Callable[[aiomqtt.Will], aiomqtt.Client]


class Whereabouts(Protocol):
    """Where the ingest session is (gateway.mqtt.session.MqttSession): the broker the
    factory's client connects to."""

    def broker(self) -> tuple[str, int]: ...

    async def moved_from(self, broker: tuple[str, int]) -> None: ...


class _Moved:
    """``_serve``'s answer when the ingest session moved to another broker."""


MOVED = _Moved()


class HostStateLink:
    def __init__(
        self,
        *,
        host_id: str,
        client: ClientFactory,
        backoff: Backoff,
        clock: Callable[[], float] = time.time,
        ingest_subscribed: asyncio.Event | None = None,
        session: Whereabouts | None = None,
    ) -> None:
        self.topic = sparkplug.state_topic(host_id)
        # Where the ingest session is (None: not followed). The link serves from there: when
        # the session moves to another broker (the one in use dead, or no longer listed after
        # a reload) while this link's broker still lives, the link says offline there and
        # connects where the session went.
        self.session = session
        # Set while the ingest session is subscribed to the Sparkplug topics (None: no wait).
        self.ingest_subscribed = ingest_subscribed
        self.client = client
        self.backoff = backoff
        self.clock = clock
        self.online = False
        # The timestamp of this link's current birth (and Will).
        self.timestamp: int | None = None
        # The highest STATE timestamp seen on the topic or published: the next is above it.
        self.highest: int | None = None
        self.births = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not await self._ingest_subscribed(stop):
                return
            self.timestamp = timestamp = self._next_timestamp()
            will = aiomqtt.Will(
                self.topic, sparkplug.state_payload(False, timestamp), qos=1, retain=True
            )
            at = None if self.session is None else self.session.broker()
            try:
                async with self.client(will) as client:
                    superseded = await self._serve(client, timestamp, stop, at)
                    if superseded is None:
                        return
                # Left with a DISCONNECT: the broker discards this Will, nobody sees it.
                self.online = False
                if isinstance(superseded, _Moved):
                    continue
                log.info("sparkplug_state_superseded", topic=self.topic, offline_at=superseded)
            except aiomqtt.MqttError as exc:
                self.online = False
                delay = self.backoff.next_delay()
                log.warning(
                    "sparkplug_state_link_lost", error=repr(exc), retry_in_s=round(delay, 3)
                )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await stop.wait()

    async def _ingest_subscribed(self, stop: asyncio.Event) -> bool:
        """Wait until the ingest session is subscribed, or ``stop`` (False)."""
        if self.ingest_subscribed is None or self.ingest_subscribed.is_set():
            return True
        log.info(
            "sparkplug_state_waits_for_ingest",
            topic=self.topic,
            note="the host's birth follows the subscription to the Sparkplug topics",
        )
        subscribed = asyncio.ensure_future(self.ingest_subscribed.wait())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({subscribed, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (subscribed, stopping):
                task.cancel()
            await asyncio.gather(subscribed, stopping, return_exceptions=True)
        return not stop.is_set()

    def _next_timestamp(self) -> int:
        now = int(self.clock() * 1000)
        return now if self.highest is None else max(now, self.highest + 1)

    def _saw(self, timestamp: int) -> None:
        self.highest = timestamp if self.highest is None else max(self.highest, timestamp)

    async def _serve(
        self,
        client: aiomqtt.Client,
        timestamp: int,
        stop: asyncio.Event,
        at: tuple[str, int] | None = None,
    ) -> int | _Moved | None:
        """Serve until ``stop`` (None), an offline STATE that would take the host offline
        for the edge nodes (its timestamp, to connect again above it), or the ingest session
        gone from ``at``, this link's broker, to another (``MOVED``)."""
        # Subscribed first: the retained STATE read back is what tells whether to speak again.
        await client.subscribe(self.topic, qos=1)
        await self._birth(client, timestamp)
        self.backoff.reset()
        reader = asyncio.create_task(self._watch(client, timestamp))
        stopping = asyncio.create_task(stop.wait())
        moved = asyncio.create_task(self._moved(at))
        try:
            done, _ = await asyncio.wait(
                {reader, stopping, moved}, return_when=asyncio.FIRST_COMPLETED
            )
            if reader in done:
                superseded = reader.result()  # the connection's error, if it ended with one
                if not stop.is_set():
                    return superseded
        finally:
            for task in (reader, stopping, moved):
                task.cancel()
            await asyncio.gather(reader, stopping, moved, return_exceptions=True)
        if stop.is_set() or moved in done:
            # A clean stop, or the session gone to another broker: say so here before the
            # disconnect (which would not send the Will). Left online, the retained STATE of a
            # broker the gateway no longer reads told its edge nodes the host was there.
            await client.publish(
                self.topic, sparkplug.state_payload(False, timestamp), qos=1, retain=True
            )
            self.online = False
            if not stop.is_set():
                log.info(
                    "sparkplug_state_moved",
                    topic=self.topic,
                    left=f"{at[0]}:{at[1]}" if at else None,
                    note="the ingest session is at another broker: the STATE follows it",
                )
                return MOVED
            log.info("sparkplug_state_offline", topic=self.topic)
        return None

    async def _moved(self, at: tuple[str, int] | None) -> None:
        """Return once the ingest session is at another broker than ``at`` (never when not
        followed)."""
        if self.session is None or at is None:
            await asyncio.Event().wait()
            return
        await self.session.moved_from(at)

    async def _birth(self, client: aiomqtt.Client, timestamp: int) -> None:
        self._saw(timestamp)
        await client.publish(
            self.topic, sparkplug.state_payload(True, timestamp), qos=1, retain=True
        )
        self.online = True
        self.births += 1
        log.info("sparkplug_state_online", topic=self.topic, timestamp=timestamp)

    async def _watch(self, client: aiomqtt.Client, timestamp: int) -> int:
        """The timestamp of the first offline STATE not older than this link's birth."""
        async for message in client.messages:
            if not message.payload and not message.retain:
                # The retained STATE cleared (`mosquitto_pub -r -n`, a clean-up sweeping retained
                # topics): the broker holds none, and an edge node connecting from now on would
                # wait for its primary host's online STATE before its births. The birth again,
                # the same timestamp (edge nodes connected change nothing).
                await client.publish(
                    self.topic, sparkplug.state_payload(True, timestamp), qos=1, retain=True
                )
                log.info("sparkplug_state_restated", topic=self.topic, timestamp=timestamp)
                continue
            state = sparkplug.parse_state(bytes(message.payload))
            if state is None:
                continue
            online, at = state
            self._saw(at)
            if not online and at >= timestamp:
                # Another session's death (a node of ours that stopped or died, connected
                # later, or an earlier session of this link): edge nodes now take the host for
                # offline. This link's own Will comes once the link is gone, and its clean
                # stop's STATE once the reader is stopped.
                return at
            if not online and not message.retain:
                # An older session's death (a node of ours that connected before this link,
                # stopped or dead, or this link's own earlier session): edge nodes connected
                # ignore it, but it is the retained STATE now, all an edge node connecting
                # from now on reads: the host offline, its births held back for good. The
                # birth again, the same timestamp (edge nodes connected change nothing).
                await client.publish(
                    self.topic, sparkplug.state_payload(True, timestamp), qos=1, retain=True
                )
                log.info(
                    "sparkplug_state_restated", topic=self.topic, timestamp=timestamp, offline_at=at
                )
        raise aiomqtt.MqttError("the STATE subscription ended")
