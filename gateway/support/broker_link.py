"""Whether this node's broker session is up, for the loops that publish through it.

The dispatcher and the outbox publisher claim nothing while it is down (a claim they cannot
publish would only lapse: a command's lapsed claim counts as a reclaim, an event's failure
grows its backoff), and the session wakes them when it is back, so that what waited for the
broker goes out at once instead of at its next poll or retry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiomqtt


class SessionDown(aiomqtt.MqttError):
    """A publish failed because the node's broker session was down, or went down before the
    PUBACK came: nothing about the message itself; it goes out again once the session is back.
    (An ``MqttError`` still, for whoever catches those.)"""


class PublishInDoubt(SessionDown):
    """The session went down after the PUBLISH was written and before its PUBACK came: the
    broker may have taken the message, and delivered it. Unlike a plain :class:`SessionDown`
    it is not known to be unsent: a command's downlink is then left to the device's receipt
    (or its absence), never sent again at once (docs/commands.md)."""


class PublishWithdrawn(Exception):
    """The publisher's ``ready`` check, asked once the message's slot under the broker's
    Receive Maximum came after a wait, said no: nothing was sent (the slot passed on)."""


# Asked once a publish's slot came after a wait, before anything is written: still wanted?
Ready = Callable[[], Awaitable[bool]]


class BrokerLink:
    """``up()``: the session can publish now. ``connected()``, called by the session each time
    it is established (subscribed), sets every event handed out by ``wakeup()``."""

    def __init__(self, up: Callable[[], bool] | None = None) -> None:
        # None: always up (a component built without a session: tests, tools).
        self._up = up
        self._wakeups: list[asyncio.Event] = []

    def up(self) -> bool:
        return True if self._up is None else self._up()

    def wakeup(self) -> asyncio.Event:
        """An event set at every reconnect (its owner clears it)."""
        event = asyncio.Event()
        self._wakeups.append(event)
        return event

    def connected(self) -> None:
        for event in self._wakeups:
            event.set()
