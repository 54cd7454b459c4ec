"""The notification metrics, registered on the daemon's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.support.metrics import MetricSet

DELIVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


class NotifyMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.deliveries = Counter(
            "gateway_notify_deliveries",
            "Delivery outcomes by receiver: SENT, RETRY (an attempt failed, another follows), "
            "FAILED (no attempts left), SILENCED, INHIBITED, SUPPRESSED (shelved, out of service), "
            "LEASE_LOST (another node took it over)",
            ["receiver", "outcome"],
            registry=r,
        )
        self.latency = Histogram(
            "gateway_notify_delivery_seconds",
            "From the event's creation to its delivery's acceptance by the receiver",
            ["receiver"],
            buckets=DELIVERY_BUCKETS,
            registry=r,
        )
        self.pending = Gauge(
            "gateway_notify_pending", "Deliveries not finished yet (PENDING or SENDING)", registry=r
        )
        self.oldest_pending_age = Gauge(
            "gateway_notify_oldest_pending_seconds",
            "Age of the oldest unfinished delivery",
            registry=r,
        )
        self.in_flight = Gauge(
            "gateway_notify_in_flight",
            "Deliveries being sent by this node",
            ["receiver"],
            registry=r,
        )
        self.events_consumed = Counter(
            "gateway_notify_events_consumed",
            "Outbox events this node turned into deliveries (possibly none)",
            registry=r,
        )
