"""The ingest pipeline's metrics (the batch writer); dead letters, batch sizes and database
retries, which the broker session, the store and the daemon count too, are in
:class:`gateway.support.metrics.Metrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.support.metrics import LATENCY_BUCKETS, MetricSet


class IngestMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
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
        self.retained_copies = Counter(
            "gateway_mapped_retained_copies",
            "Retained copies of vendor readings the broker sent at a subscription (each start "
            "and reconnection), not read: no report of the device (docs/devices.md)",
            registry=r,
        )
        self.empty_messages = Counter(
            "gateway_empty_messages",
            "Zero-length messages (a retained message cleared, or a device sending nothing), "
            "acknowledged and not read, by the kind of topic: telemetry, status, acks, sparkplug, "
            "other (docs/topics-and-payloads.md)",
            ["kind"],
            registry=r,
        )
        self.presence_updates = Counter(
            "gateway_presence_updates", "Device presence messages applied", registry=r
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
        self.statements = Counter(
            "gateway_ingest_statements",
            "Statements the ingest writer sent to PostgreSQL, each a round trip (BEGIN and COMMIT "
            "included); divided by gateway_ingest_transactions: the round trips per batch",
            registry=r,
        )
        self.transactions = Counter(
            "gateway_ingest_transactions",
            "Transactions the ingest writer ran (a batch's, its retries and its isolation)",
            registry=r,
        )
        self.lost_commits = Counter(
            "gateway_ingest_lost_commits",
            "Batches whose COMMIT answer was lost with the connection, by what PostgreSQL then "
            "said of the transaction: committed (done, not stored again), aborted or unknown "
            "(stored again), in_progress (still unfinished after the wait; stored again), "
            "other_server (a failover or a restart since: not asked; stored again)",
            ["status"],
            registry=r,
        )
        self.batch_refusals = Counter(
            "gateway_ingest_batch_refusals",
            "Batches PostgreSQL refused for their content; explained: whether messages refused "
            "on their own were found (and dead-lettered) or not (retried with backoff, then the "
            "whole batch dead-lettered)",
            ["explained"],
            registry=r,
        )
