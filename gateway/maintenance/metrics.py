"""Retention's metrics: sampled by the maintenance pass (on the node that ran it), not at
scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.support.metrics import MetricSet


class MaintenanceMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.table_rows = Gauge(
            "gateway_table_rows",
            "Rows per table, as PostgreSQL estimates them (telemetry: all its partitions)",
            ["table"],
            registry=r,
        )
        self.table_bytes = Gauge(
            "gateway_table_bytes",
            "Bytes on disk per table, indexes and TOAST included (telemetry: all its partitions)",
            ["table"],
            registry=r,
        )
        self.telemetry_oldest_day = Gauge(
            "gateway_telemetry_oldest_day_timestamp_seconds",
            "Start (UTC) of the oldest day holding telemetry; NaN when there is none",
            registry=r,
        )
        self.retention_deleted = Counter(
            "gateway_retention_deleted",
            "Rows deleted by retention, by table (ai_task_payloads: payloads cleared)",
            ["table"],
            registry=r,
        )
        self.retention_partitions_dropped = Counter(
            "gateway_retention_partitions_dropped",
            "Telemetry day partitions dropped by retention",
            registry=r,
        )
        self.maintenance_last_pass = Gauge(
            "gateway_maintenance_last_pass_timestamp_seconds",
            "When this node last completed a maintenance pass (its clock)",
            registry=r,
        )
