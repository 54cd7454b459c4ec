"""Zero-length messages in the decoder (gateway/ingest/decoder.py): counted by the kind of
topic, nothing else; an empty reading counts no device heard (it used to: its device went into
``seen_devices`` before the payload was decoded, and its last_seen moved)."""

from __future__ import annotations

import time

from gateway.config import parse_config
from gateway.ingest.decoder import Inbound
from gateway.ingest.live_path import message_decoder


def test_empty_messages_are_counted_by_kind_and_nothing_else() -> None:
    config = parse_config(
        '[sparkplug]\nenabled = true\nhost_id = "gw"\n'
        '[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n'
    )
    decoder = message_decoder(config)
    topics = [
        "iot/devices/dev-1/telemetry",
        "iot/devices/dev-1/status",
        "iot/devices/dev-1/acks",
        "iot/devices/dev-1/commands",
        "iot/devices/bad id/status",
        "zigbee2mqtt/lamp",
        "zigbee2mqtt/lamp/availability",
        "spBv1.0/G/DDEATH/N/D",
        "spBv1.0/G/NBIRTH/N",
    ]
    batch = decoder.classify([Inbound(topic, b"", time.monotonic()) for topic in topics])
    assert batch.empty == {"telemetry": 2, "status": 2, "acks": 1, "other": 2, "sparkplug": 2}
    assert batch.seen_devices == set(), "an empty reading counted its device heard"
    assert batch.dead_letters == []
    assert (batch.telemetry, batch.presence, batch.receipts, batch.sparkplug) == ([], {}, [], [])
    assert batch.mapped_devices == {}
