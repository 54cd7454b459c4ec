"""The decoder's telemetry rows: the event id it computes without checking the device id a
second time (the topic's parse checked it) is `telemetry_event_id`'s, and a device id the
parse refuses never gets one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.ingest.decoder import Inbound, MessageDecoder
from protocol import (
    Encoding,
    Telemetry,
    Topics,
    checked_device_event_id,
    encode_telemetry,
    telemetry_event_id,
)
from protocol.messages import MAX_EPOCH_MS

TOPICS = Topics()
DEVICE_IDS = st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True)
MESSAGES = st.builds(
    Telemetry,
    ts=st.integers(0, MAX_EPOCH_MS),
    seq=st.none() | st.integers(0, 2**63 - 1),
    metrics=st.dictionaries(
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
        st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=4,
    ),
)


@given(DEVICE_IDS, MESSAGES, st.sampled_from(Encoding), st.booleans())
def test_the_rows_event_id_is_telemetry_event_id(
    device_id: str, message: Telemetry, encoding: Encoding, keyed_first: bool
) -> None:
    decoder = MessageDecoder(TOPICS, encoding, 65536)
    item = Inbound(TOPICS.telemetry(device_id), encode_telemetry(message, encoding))
    if keyed_first:  # as the writer does: the ordering key parses the topic first
        assert decoder.order_key(item) == device_id
    out = decoder.classify([item])
    assert [row.device_id for row in out.telemetry] == [device_id]
    assert out.telemetry[0].event_id == telemetry_event_id(device_id, message)
    assert checked_device_event_id(device_id, message) == telemetry_event_id(device_id, message)


def test_a_device_id_the_topic_refuses_is_a_dead_letter_with_no_row() -> None:
    decoder = MessageDecoder(TOPICS, Encoding.JSON, 65536)
    payload = encode_telemetry(Telemetry(ts=1, metrics={"a": 1}))
    items = [
        Inbound(f"iot/devices/{device_id}/telemetry", payload)
        for device_id in ("x" * 65, "a b", "é")
    ]
    for item in items:
        assert decoder.order_key(item) == ""
    out = decoder.classify(items)
    assert out.telemetry == []
    assert [letter.reason for letter in out.dead_letters] == ["BAD_DEVICE_ID"] * 3
