"""The AI summary worker's metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.support.metrics import MetricSet


class AiMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ai_tasks = Counter(
            "gateway_ai_tasks", "AI summary task outcomes", ["status", "error_code"], registry=r
        )
        self.ai_latency = Histogram(
            "gateway_ai_call_seconds",
            "Duration of one LLM call (claim to result)",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120),
            registry=r,
        )
