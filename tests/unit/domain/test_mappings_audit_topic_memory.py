"""A publisher on a mapping's topic with long, ever new topic names (a misconfigured client
putting a document or a random string in the topic; MQTT allows 65,535 bytes): what a
`Mappings` holds per topic met stays near its documented bound (TOPICS_HELD topics, ~0.4 KB
each), whatever the topics' length."""

from __future__ import annotations

import tracemalloc

from gateway.config import parse_config
from gateway.domain.mappings import compiled
from gateway.ingest.decoder import Inbound, MessageDecoder
from protocol import Encoding, Topics

TOPIC_CHARS = 4_000


def test_long_topics_met_once_are_not_held_whole() -> None:
    config = parse_config('[[ingest.mappings]]\nname = "m"\nprofile = "tasmota"\n')
    decoder = MessageDecoder(Topics("iot"), Encoding.JSON, 65536, mappings=config.mappings())
    sensor = b'{"Time":"2026-12-07T10:00:00","AM2301":{"Temperature":21.5}}'
    # Warm up what a first message loads (regular expressions, msgspec decoders).
    decoder.classify([Inbound(topic="tele/warm/SENSOR", payload=sensor)])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(compiled.TOPICS_HELD - 1):
            noise = f"{n:08d}".ljust(TOPIC_CHARS, "x")
            out = decoder.classify(
                [
                    Inbound(topic=f"tele/{noise}/SENSOR", payload=sensor),  # a refused id
                    Inbound(topic=f"iot/devices/{noise}/telemetry", payload=b"{}"),  # no mapping's
                ]
            )
            assert len(out.dead_letters) == 2
            del out
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # At most ~1.2 KB a topic held (~10 MB for 8,192): not the topics' own 4 KB each
    # (~68 MB held until the next 8,192 new topics).
    assert held < compiled.TOPICS_HELD * 1_200, held
