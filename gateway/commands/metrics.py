"""The command path's own metrics: receipts, dispatch and creation batches, the latency from
claim to receipt. (Command transitions, which several layers count, are in
:class:`gateway.support.metrics.Metrics`.)"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.support.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, MetricSet


class CommandMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.command_receipts = Counter(
            "gateway_command_receipts",
            "Command receipts by outcome and reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.command_claim_batch = Histogram(
            "gateway_command_claim_batch_size",
            "Commands claimed per dispatch pass",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.command_create_batch = Histogram(
            "gateway_command_create_batch_size",
            "API command creations per transaction (concurrent requests share one)",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.command_latency = Histogram(
            "gateway_command_dispatch_to_receipt_seconds",
            "From the claim of a command to the receipt that finished it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
