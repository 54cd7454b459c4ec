"""Audit: the chirpstack-v4 profile read a LoRaWAN device's link (`rssi`, `snr`) from
`rxInfo[0]`, whichever gateway ChirpStack listed first (its deduplication set has no order):
now the greatest of every gateway's, through a metric path's `[*]` step
(tests/integration/acceptance/test_mappings_audit_lora_gateways.py is the daemon's proof)."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError
from gateway.domain.mappings import MappedTelemetry

NOW_MS = 1_767_225_600_000
TOPIC = "application/app/device/0101010101010101/event/up"
CHIRPSTACK = '[[ingest.mappings]]\nname = "lora"\nprofile = "chirpstack-v4"\n'


def _link(rx_info: bytes) -> dict[str, object]:
    payload = b'{"time": "2026-01-01T00:00:00Z", "fCnt": 7, "rxInfo": ' + rx_info + b"}"
    read = parse_config(CHIRPSTACK).mappings().read(TOPIC, payload, NOW_MS)
    assert isinstance(read, MappedTelemetry), read
    assert read.message.metrics is not None
    return {k: v for k, v in read.message.metrics.items() if k in ("rssi", "snr")}


@pytest.mark.parametrize(
    "rx_info",
    [
        b'[{"rssi": -62, "snr": 9.5}, {"rssi": -117, "snr": -13.2}]',
        b'[{"rssi": -117, "snr": -13.2}, {"rssi": -62, "snr": 9.5}]',
    ],
)
def test_the_link_is_the_best_gateways_whatever_their_order(rx_info: bytes) -> None:
    assert _link(rx_info) == {"rssi": -62, "snr": 9.5}


def test_no_gateway_figure_no_link_metric() -> None:
    assert _link(b"[]") == {}
    assert _link(b'[{"gatewayId": "0016c001f153a14c"}, {"rssi": "weak"}]') == {}


def test_every_item_is_for_a_metrics_path_only() -> None:
    """And the time's, since the profile reads every gateway's `nsTime`
    (tests/unit/domain/test_mappings_audit_lora_clocks.py)."""
    with pytest.raises(ConfigError) as refused:
        parse_config(CHIRPSTACK + 'device_path = "$.rxInfo[*].gatewayId"\n')
    assert "ingest.mappings[0].device_path" in str(refused.value)
