"""Audit: the time of a ChirpStack uplink (tests/integration/acceptance/
test_mappings_audit_lora_time.py is the daemon's proof). ChirpStack v4 dates the event by
the first gateway in `rxInfo` that has a time (no order): the profile reads when ChirpStack
received each gateway's copy (`nsTime`, its own clock), the middle one, else `time`. A
mapping's `timestamp_path` may name paths tried in order, and `[*]` reads every item's."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import msgspec
import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError
from gateway.domain.mappings import MappedTelemetry, Refusal

NOW_MS: Final = 1_767_225_600_000
TOPIC: Final = "application/app/device/0101010101010101/event/up"
FIXTURE: Final = Path(__file__).resolve().parents[2] / "fixtures" / "mappings"
CHIRPSTACK: Final = '[[ingest.mappings]]\nname = "lora"\nprofile = "chirpstack-v4"\n'
AT_MS: Final = 1_767_225_000_000  # 2025-12-31T23:50:00Z


def _ts(toml: str, document: dict[str, object], topic: str = TOPIC) -> int:
    read = parse_config(toml).mappings().read(topic, msgspec.json.encode(document), NOW_MS)
    assert isinstance(read, MappedTelemetry), read
    return read.message.ts


def _rx(gw_time: str, ns_time: str | None) -> dict[str, object]:
    item: dict[str, object] = {"gatewayId": gw_time, "rssi": -80, "gwTime": gw_time}
    if ns_time is not None:
        item["nsTime"] = ns_time
    return item


def _uplink(*rx_info: dict[str, object]) -> dict[str, object]:
    return {"time": rx_info[0]["gwTime"], "fCnt": 1, "object": {"t": 1}, "rxInfo": list(rx_info)}


@pytest.mark.parametrize("ahead_first", [True, False])
def test_the_network_servers_time_whatever_the_gateways_clocks(ahead_first: bool) -> None:
    on_time = _rx("2025-12-31T23:50:00Z", "2025-12-31T23:50:00.040Z")
    ahead = _rx("2026-01-01T00:50:00Z", "2025-12-31T23:50:00.055Z")
    behind = _rx("2025-12-31T22:50:00Z", "2025-12-31T23:50:00.048Z")
    order = [ahead, behind, on_time] if ahead_first else [on_time, behind, ahead]
    assert _ts(CHIRPSTACK, _uplink(*order)) == AT_MS + 48
    pair = [ahead, behind] if ahead_first else [behind, ahead]
    assert _ts(CHIRPSTACK, _uplink(*pair)) == AT_MS + 48
    assert _ts(CHIRPSTACK, _uplink(on_time, ahead)) == AT_MS + 40


def test_no_network_server_time_the_events_own() -> None:
    """ChirpStack's documented event (no time in rxInfo), or one without nsTime."""
    documented = msgspec.json.decode((FIXTURE / "chirpstack-v4-up.json").read_bytes())
    assert _ts(CHIRPSTACK, documented) == 1_658_136_855_775
    assert _ts(CHIRPSTACK, _uplink(_rx("2025-12-31T23:50:00Z", None))) == AT_MS


def test_a_network_server_time_that_is_no_time_is_refused() -> None:
    document = _uplink(_rx("2025-12-31T23:50:00Z", "soon"))
    read = parse_config(CHIRPSTACK).mappings().read(TOPIC, msgspec.json.encode(document), NOW_MS)
    assert isinstance(read, Refusal)
    assert read.code == "MAPPING_BAD_TIMESTAMP"
    assert "$.rxInfo[*].nsTime" in read.detail


def test_paths_are_tried_in_order() -> None:
    toml = (
        '[[ingest.mappings]]\nname = "m"\ntopic = "t/{device}"\ndevice = "{device}"\n'
        'timestamp_path = ["$.at", "$.meta.at"]\ntimestamp_format = "epoch_ms"\n'
        'metrics = [{ path = "$.v", name = "v" }]\n'
    )
    assert _ts(toml, {"at": 5, "meta": {"at": 7}, "v": 1}, "t/d") == 5
    assert _ts(toml, {"meta": {"at": 7}, "v": 1}, "t/d") == 7
    with pytest.raises(ConfigError) as refused:
        parse_config(toml.replace('"$.meta.at"', '"meta..at"'))
    assert "ingest.mappings[0].timestamp_path[1]" in str(refused.value)
