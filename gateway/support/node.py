"""What every component of one node shares, handed over whole instead of one argument each."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

import asyncpg

from gateway.support.broker_link import BrokerLink, Ready
from gateway.support.metrics import Metrics
from protocol import Topics


class Publish(Protocol):
    """QoS 1 on the node's broker connection; returns after the broker's PUBACK, with its MQTT
    5 reason code (0: delivered to subscribers, 0x10: nobody subscribed) or None on MQTT 3.1.1,
    whose PUBACK carries none. ``ready``: asked when the message had to wait for a slot under
    the broker's Receive Maximum, before it is written; False raises ``PublishWithdrawn``."""

    def __call__(
        self, topic: str, payload: bytes, /, *, ready: Ready | None = None
    ) -> Awaitable[int | None]: ...


@dataclass(frozen=True, slots=True)
class Node:
    """One node's identity and shared resources: the pool (and the DSN for LISTEN
    connections), the topics, the metrics, how to publish, and whether the broker is there."""

    node_id: str
    pool: asyncpg.Pool
    dsn: str
    topics: Topics
    metrics: Metrics
    publish: Publish
    broker: BrokerLink = field(default_factory=BrokerLink)
