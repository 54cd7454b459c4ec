"""The outbox's metrics: its backlog and the age of its oldest event, what was published, failed
or given up."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.support.metrics import MetricSet


class OutboxMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.outbox_backlog = Gauge(
            "gateway_outbox_backlog", "Outbox events not yet published", registry=r
        )
        self.outbox_oldest_age = Gauge(
            "gateway_outbox_oldest_age_seconds",
            "Age of the oldest unpublished outbox event",
            registry=r,
        )
        self.outbox_published = Counter(
            "gateway_outbox_published",
            "Outbox events published, by type",
            ["event_type"],
            registry=r,
        )
        self.outbox_failures = Counter(
            "gateway_outbox_failures", "Outbox publish attempts that failed", registry=r
        )
        self.outbox_dead = Counter(
            "gateway_outbox_dead",
            "Outbox events given up: the broker can never take them (too large, refused for good)",
            registry=r,
        )
