"""Declarative mappings of vendor JSON devices onto the gateway's telemetry and presence
(``[[ingest.mappings]]``, docs/devices.md). Pure: the ingest decoder and the command
dispatcher use what ``compile_mappings`` returns."""

from gateway.domain.mappings.compiled import (
    REASONS,
    RETRANSMISSION_WINDOW_S,
    Downlink,
    DownlinkError,
    MappedPresence,
    MappedTelemetry,
    Mappings,
    Refusal,
    compile_mappings,
)
from gateway.domain.mappings.config import (
    PROFILES,
    EventMapConfig,
    MappingConfig,
    MetricMapConfig,
    resolve,
)

__all__ = [
    "PROFILES",
    "REASONS",
    "RETRANSMISSION_WINDOW_S",
    "Downlink",
    "DownlinkError",
    "EventMapConfig",
    "MappedPresence",
    "MappedTelemetry",
    "MappingConfig",
    "Mappings",
    "MetricMapConfig",
    "Refusal",
    "compile_mappings",
    "resolve",
]
