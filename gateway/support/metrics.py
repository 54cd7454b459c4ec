"""Prometheus metrics, one registry per daemon (several daemons can share a test process).

:class:`Metrics` holds the registry, the process and build collectors, and the metrics that
several layers or the daemon's wiring share (database, dead letters, the batch size, command
and alarm transitions, audit failures). A feature's own metrics live beside it, as a
:class:`MetricSet` (``gateway/ingest/metrics.py``, ``gateway/commands/metrics.py``,
``gateway/mqtt/metrics.py``, ``gateway/outbox/metrics.py``, ``gateway/notify/metrics.py``, ...),
registered once per registry.
"""

from __future__ import annotations

import gc
import weakref
from typing import Self, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.support.version import gateway_version

# No `<name>_created` series next to every counter and histogram (the process start time of a
# counter, which Prometheus does not need and which doubled the series).
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client

BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


_SETS: weakref.WeakKeyDictionary[CollectorRegistry, dict[type[MetricSet], MetricSet]] = (
    weakref.WeakKeyDictionary()
)


class MetricSet:
    """A feature's metrics: define them in ``__init__`` on ``registry``; get them with
    :meth:`of`, which registers them once per registry (a daemon built twice registers once)."""

    @classmethod
    def of(cls, registry: CollectorRegistry) -> Self:
        sets = _SETS.setdefault(registry, {})
        found = sets.get(cls)
        if found is None:
            found = sets[cls] = cls(registry)
        return cast(Self, found)

    def __init__(self, registry: CollectorRegistry) -> None:
        del registry


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds...
        GCCollector(registry=r)  # python_gc_collections_total and objects collected, by generation
        Gauge(
            "gateway_gc_frozen_objects",
            "Objects of the start-up (modules, the HTTP app, ...) taken out of the garbage "
            "collector's full passes once the daemon was ready (gc.freeze)",
            registry=r,
        ).set_function(gc.get_freeze_count)
        Info("gateway_build", "The running release", registry=r).info(
            {"version": gateway_version()}
        )
        self.dead_letters = Counter(
            "gateway_dead_letters", "Messages dead-lettered, by reason code", ["reason"], registry=r
        )
        self.batch_size = Histogram(
            "gateway_ingest_batch_size",
            "Messages per ingest transaction",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.db_retries = Counter(
            "gateway_db_retries",
            "Transactions retried after a database connection failure",
            registry=r,
        )
        self.db_pool_size = Gauge(
            "gateway_db_pool_size", "Connections open in the pool", registry=r
        )
        self.db_pool_idle = Gauge(
            "gateway_db_pool_idle", "Idle connections in the pool", registry=r
        )

        self.alarm_transitions = Counter(
            "gateway_alarm_transitions",
            "Alarm status changes",
            ["from_status", "to_status"],
            registry=r,
        )

        self.command_transitions = Counter(
            "gateway_command_transitions",
            "Command status changes",
            ["from_status", "to_status"],
            registry=r,
        )

        # Audit rows PostgreSQL refused (the change they recorded rolled back with them).
        self.audit_failures = Counter(
            "gateway_audit_failures",
            "Audit rows (alarm or command) that could not be written; their changes rolled back",
            registry=r,
        )

    def count_command(self, from_status: str, to_status: str, n: int = 1) -> None:
        self.command_transitions.labels(from_status, to_status).inc(n)

    def count_alarm_transition(self, from_status: str, to_status: str) -> None:
        self.alarm_transitions.labels(from_status, to_status).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``histogram.observe(value)`` ``count`` times, at the cost of one.

    prometheus_client has no weighted observe, and a batch of messages acknowledged together
    shares one latency per reader chunk; observing each cost a lock and a bucket search per
    message. This adds ``count`` to the sum's share and to the first bucket ``value`` fits,
    exactly what ``observe`` does once (checked against it by a test).
    """
    if count == 1:
        histogram.observe(value)
        return
    histogram._sum.inc(value * count)
    for index, bound in enumerate(histogram._upper_bounds):
        if value <= bound:
            histogram._buckets[index].inc(count)
            break
