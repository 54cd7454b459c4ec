"""The broker session's metrics: connection attempts, whether connected, read pauses."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.support.metrics import MetricSet


class MqttMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.mqtt_connects = Counter(
            "gateway_mqtt_connects",
            "Broker connection attempts, by outcome",
            ["outcome"],
            registry=r,
        )
        self.mqtt_connected = Gauge(
            "gateway_mqtt_connected", "1 while connected to the broker", registry=r
        )
        self.mqtt_endpoint = Gauge(
            "gateway_mqtt_endpoint",
            "1 for the broker endpoint ([mqtt] hosts) connected to, 0 for the others",
            ["endpoint"],
            registry=r,
        )
        self.endpoint_switches = Counter(
            "gateway_mqtt_endpoint_switches",
            "Sessions established on another broker endpoint than the last one",
            registry=r,
        )
        self.read_pauses = Counter(
            "gateway_mqtt_read_pauses",
            "Times reading the broker connection paused, by the bound of the read buffer that "
            "was reached (messages: [ingest] read_buffer, bytes: [ingest] read_buffer_bytes)",
            ["bound"],
            registry=r,
        )
