"""The Sparkplug host's metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from gateway.support.metrics import MetricSet


class SparkplugMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.messages = Counter(
            "gateway_sparkplug_messages",
            "Sparkplug messages judged (births, deaths, data), by message type",
            ["type"],
            registry=r,
        )
        self.duplicates = Counter(
            "gateway_sparkplug_duplicates",
            "Sparkplug messages skipped as redeliveries of ones already applied",
            registry=r,
        )
        self.distrusted = Counter(
            "gateway_sparkplug_untrusted",
            "Edge nodes found out of step (a seq gap or reset, an unknown alias, data before "
            "a birth): their data is not judged by the rules until their next NBIRTH",
            registry=r,
        )
        self.rebirth_requests = Counter(
            "gateway_sparkplug_rebirth_requests",
            "Rebirth requests (NCMD Node Control/Rebirth) published to edge nodes",
            registry=r,
        )
