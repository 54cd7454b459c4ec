"""observe_many reaches into prometheus_client's Histogram: it must equal observing n times."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.support.metrics import observe_many

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(histogram_registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for metric in histogram_registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize("value", [0.0, 0.0005, 0.001, 0.0011, 0.5, 1.0, 7.5])
@pytest.mark.parametrize("count", [1, 2, 500])
def test_observe_many_equals_observing_one_by_one(value: float, count: int) -> None:
    one, many = CollectorRegistry(), CollectorRegistry()
    by_one = Histogram("h", "h", buckets=BUCKETS, registry=one)
    at_once = Histogram("h", "h", buckets=BUCKETS, registry=many)
    by_one.observe(0.05)
    at_once.observe(0.05)
    for _ in range(count):
        by_one.observe(value)
    observe_many(at_once, value, count)
    assert _samples(many) == pytest.approx(_samples(one))
