"""The live stream's metrics (``GET /stream``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.support.metrics import MetricSet


class StreamMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
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
