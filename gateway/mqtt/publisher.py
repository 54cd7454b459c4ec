"""Publishing on the node's broker session: the downlinks of the command dispatcher and the
outbox's events reach the broker through :class:`SessionPublisher` (``Node.publish``), so
neither climbs to the daemon for it."""

from __future__ import annotations

from collections.abc import Callable

import aiomqtt

from gateway.mqtt.session import MqttSession
from gateway.support.broker_link import PublishInDoubt, Ready, SessionDown
from gateway.support.publish_refusal import PublishRefused


class SessionPublisher:
    """QoS 1 publishes on whatever session the node has now (``session``: None before the
    daemon built it, and between its stop and exit)."""

    def __init__(self, session: Callable[[], MqttSession | None]) -> None:
        self._session = session

    def up(self) -> bool:
        """The session can publish now (what :meth:`publish` checks first): connected *and*
        subscribed. Between the two (the subscription memory written, each SUBACK awaited) a
        downlink sent at once could be answered before the receipts' subscription exists: the
        broker would give that receipt to nobody on this session, and the command would wait
        SENT for its ack window. The daemon's dispatcher and outbox are woken once it is."""
        session = self._session()
        client = None if session is None else session.client
        return (
            session is not None
            and session.connected
            and session.subscribed
            and client is not None
            and client.is_open
        )

    async def publish(
        self, topic: str, payload: bytes, /, *, ready: Ready | None = None
    ) -> int | None:
        """QoS 1; returns after the broker's PUBACK, with its reason code (MQTT 5) or None
        (3.1.1: the PUBACK has none).

        Raises :class:`SessionDown` when the session is down, or went down before the PUBACK
        came: the callers put the message back at once rather than count it as failed
        (:class:`PublishInDoubt`, a ``SessionDown``, when the PUBLISH had been written: the
        broker may have taken it); and
        :class:`PublishRefused` when the broker refused this message (``final``: it never will
        take it), even if it dropped the connection for it; :class:`PublishWithdrawn` when
        ``ready``, asked once a slot came after a wait, said no (nothing was sent).
        """
        session = self._session()
        client = None if session is None else session.client
        if client is None or not self.up():
            raise SessionDown("not connected to the broker")
        try:
            return await client.publish(topic, payload, qos=1, ready=ready)
        except PublishRefused:
            raise  # about this message, not the session: even when the broker hung up for it
        except PublishInDoubt:
            raise  # written before the session went down: the broker may have it
        except aiomqtt.MqttError as exc:
            if not client.is_open:
                raise SessionDown(f"the broker connection ended: {exc}") from exc
            raise
