"""Prometheus metrics, one registry per daemon (several daemons can share a test process)."""

from __future__ import annotations

import gc

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
        self.telemetry_received = Counter(
            "gateway_telemetry_received", "Telemetry messages received from the broker", registry=r
        )
        self.telemetry_stored = Counter(
            "gateway_telemetry_stored", "Telemetry messages stored (new event ids)", registry=r
        )
        self.telemetry_duplicates = Counter(
            "gateway_telemetry_duplicates",
            "Telemetry messages whose event id was already stored (redeliveries)",
            registry=r,
        )
        self.presence_updates = Counter(
            "gateway_presence_updates", "Device presence messages applied", registry=r
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
        self.commit_seconds = Histogram(
            "gateway_ingest_commit_seconds",
            "Duration of one ingest transaction",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.handler_seconds = Histogram(
            "gateway_ingest_handler_seconds",
            "From receipt of a message to its acknowledgement to the broker",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "gateway_ingest_inflight", "Messages received and not yet acknowledged", registry=r
        )
        self.acks_skipped = Counter(
            "gateway_acks_skipped",
            "Stored messages whose connection closed before the ack (the broker redelivers)",
            registry=r,
        )
        self.db_retries = Counter(
            "gateway_db_retries",
            "Transactions retried after a database connection failure",
            registry=r,
        )
        self.mqtt_connects = Counter(
            "gateway_mqtt_connects",
            "Broker connection attempts, by outcome",
            ["outcome"],
            registry=r,
        )
        self.mqtt_connected = Gauge(
            "gateway_mqtt_connected", "1 while connected to the broker", registry=r
        )
        self.db_pool_size = Gauge(
            "gateway_db_pool_size", "Connections open in the pool", registry=r
        )
        self.db_pool_idle = Gauge(
            "gateway_db_pool_idle", "Idle connections in the pool", registry=r
        )

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
        self.streams_open = Gauge(
            "gateway_streams_open", "Live streams (GET /stream) open on this node", registry=r
        )
        self.streams_dropped = Counter(
            "gateway_streams_dropped",
            "Live streams the node ended: behind (too many events queued), stalled (its "
            "socket took nothing within the write deadline), revoked (its token was reloaded "
            "away)",
            ["reason"],
            registry=r,
        )
        self.stream_refusals = Counter(
            "gateway_stream_refusals",
            "Streams and stream tickets refused by a limit, by error code",
            ["code"],
            registry=r,
        )
        self.alarms_created = Counter(
            "gateway_alarms_created", "Alarms raised, by rule", ["rule_key"], registry=r
        )
        self.alarms_deduplicated = Counter(
            "gateway_alarms_deduplicated", "Firings that hit an existing dedup key", registry=r
        )
        self.alarms_superseded = Counter(
            "gateway_alarms_superseded", "Alarms superseded by a newer one", registry=r
        )
        self.alarms_cleared = Counter(
            "gateway_alarms_cleared", "Alarms marked cleared by recovery", registry=r
        )
        self.alarms_late = Counter(
            "gateway_alarms_late",
            "Alarms raised by a sample committed after a newer one (created already cleared "
            "or superseded)",
            registry=r,
        )
        self.clock_adjustments = Counter(
            "gateway_clock_adjustments",
            "Samples judged at their receipt instead of their device time, by why: ahead (dated "
            "past max_future_skew_s), behind (back past reorder_window_s: a reset or an upload), "
            "state_ahead (a rule state held times from a clock ahead)",
            ["reason"],
            registry=r,
        )
        self.rule_states_written = Counter(
            "gateway_rule_states_written",
            "Rule state rows written back by ingest batches",
            registry=r,
        )
        self.alarms_unreached = Counter(
            "gateway_alarms_unreached",
            "Alarms still NEW after [alarms] unreached_after_s: no subscriber, no receiver "
            "reached a person",
            registry=r,
        )
        self.alarm_transitions = Counter(
            "gateway_alarm_transitions",
            "Alarm status changes",
            ["from_status", "to_status"],
            registry=r,
        )

        self.command_receipts = Counter(
            "gateway_command_receipts",
            "Command receipts by outcome and reason",
            ["outcome", "reason"],
            registry=r,
        )

        self.command_transitions = Counter(
            "gateway_command_transitions",
            "Command status changes",
            ["from_status", "to_status"],
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

        self.ai_tasks = Counter(
            "gateway_ai_tasks", "AI summary task outcomes", ["status", "error_code"], registry=r
        )
        self.ai_latency = Histogram(
            "gateway_ai_call_seconds",
            "Duration of one LLM call (claim to result)",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120),
            registry=r,
        )

        # Audit rows PostgreSQL refused (the change they recorded rolled back with them).
        self.audit_failures = Counter(
            "gateway_audit_failures",
            "Audit rows (alarm or command) that could not be written; their changes rolled back",
            registry=r,
        )
        # Faults of the ingest path.
        self.batch_refusals = Counter(
            "gateway_ingest_batch_refusals",
            "Batches PostgreSQL refused for their content; explained: whether messages refused "
            "on their own were found (and dead-lettered) or not (retried with backoff, then the "
            "whole batch dead-lettered)",
            ["explained"],
            registry=r,
        )
        self.read_pauses = Counter(
            "gateway_mqtt_read_pauses",
            "Times reading the broker connection paused, by the bound of the read buffer that "
            "was reached (messages: [ingest] read_buffer, bytes: [ingest] read_buffer_bytes)",
            ["bound"],
            registry=r,
        )
        self._retention_metrics(r)

    def _retention_metrics(self, r: CollectorRegistry) -> None:
        # Retention: sampled by the maintenance pass (on the node that ran it), not at scrape.
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
