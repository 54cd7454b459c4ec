"""A device on a flattening mapping (Tasmota, Zigbee2MQTT, ...) whose documents hold long,
ever new keys (a firmware writing a log line, a hash or a document as a key): the leaves'
names a mapping holds stay near their documented bound (FLAT_NAMES_HELD, ~0.2 KB each),
whatever the keys' length. A name over 64 characters is left out of the reading anyway."""

from __future__ import annotations

import tracemalloc

import msgspec

from gateway.config import parse_config
from gateway.domain.mappings import compiled
from gateway.ingest.decoder import Inbound, MessageDecoder
from protocol import Encoding, Topics

KEY_CHARS = 4_000


def test_long_keys_met_once_are_not_held_whole() -> None:
    config = parse_config('[[ingest.mappings]]\nname = "m"\nprofile = "tasmota"\n')
    decoder = MessageDecoder(Topics("iot"), Encoding.JSON, 65536, mappings=config.mappings())

    def sensor(key: str) -> bytes:
        return msgspec.json.encode(
            {"Time": "2026-12-07T10:00:00", "AM2301": {"Temperature": 21.5}, key: 1}
        )

    decoder.classify([Inbound(topic="tele/plug-1/SENSOR", payload=sensor("warm"))])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(compiled.FLAT_NAMES_HELD - 4):  # 3 held before: never emptied
            key = f"{n:08d}".ljust(KEY_CHARS, "x")
            out = decoder.classify([Inbound(topic="tele/plug-1/SENSOR", payload=sensor(key))])
            assert [row.metrics for row in out.decoded] == [{"AM2301.Temperature": 21.5}]
            del out
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # ~0.2 KB a name held, with room (~0.8 MB for 4,096): not the keys' own 4 KB each
    # (~16 MB held per mapping until 4,096 more keys came).
    assert held < compiled.FLAT_NAMES_HELD * 500, held
