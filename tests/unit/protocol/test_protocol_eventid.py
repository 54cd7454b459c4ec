from __future__ import annotations

import hashlib
import json
import random
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    Encoding,
    InvalidDeviceIdError,
    Telemetry,
    canonical_bytes,
    decode_telemetry,
    encode_telemetry,
    telemetry_event_id,
)
from protocol.messages import INT64_MAX, INT64_MIN, MAX_EPOCH_MS

# --- strategies: every value they produce is a valid, decodable Telemetry --------------------

IDENTIFIERS = st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True)
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
INT64 = st.integers(INT64_MIN, INT64_MAX)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
METRIC_VALUES = st.one_of(INT64, FLOATS, st.booleans(), TEXT)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | INT64 | FLOATS | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
OFFSETS = st.integers(-(23 * 60 + 59), 23 * 60 + 59).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)
SEQS = st.integers(0, INT64_MAX)
TIMESTAMPS = st.one_of(
    st.integers(0, MAX_EPOCH_MS),
    # Local times a day inside the accepted range, so that any offset keeps them in it.
    st.datetimes(
        min_value=datetime(1970, 1, 2),
        max_value=datetime(9998, 12, 30),
        timezones=st.just(UTC) | OFFSETS,
    ),
)


def events(types: st.SearchStrategy[str], extras: st.SearchStrategy[Any]) -> Any:
    return st.builds(
        lambda event_type, extra: {**extra, "type": event_type},
        types,
        st.dictionaries(TEXT, extras, max_size=3),
    )


@st.composite
def telemetry(
    draw: st.DrawFn,
    *,
    timestamps: st.SearchStrategy[int | datetime] = TIMESTAMPS,
    seqs: st.SearchStrategy[int] = SEQS,
    names: st.SearchStrategy[str] = IDENTIFIERS,
    metric_values: st.SearchStrategy[Any] = METRIC_VALUES,
    event_values: st.SearchStrategy[Any] = JSON_VALUES,
) -> Telemetry:
    metrics = draw(st.none() | st.dictionaries(names, metric_values, max_size=4))
    event_list = draw(st.none() | st.lists(events(names, event_values), max_size=3))
    if not metrics and not event_list:
        metrics = {draw(names): draw(metric_values)}
    return Telemetry(
        ts=draw(timestamps), seq=draw(st.none() | seqs), metrics=metrics, events=event_list
    )


# A tiny domain, so that pairs are often equal or differ only by a value's type or sign.
SMALL_VALUES = st.sampled_from([0, 1, 0.0, -0.0, 1.0, True, False, "", "0", "1", "a"])
DEVICE_IDS = IDENTIFIERS


def typed(value: object) -> object:
    """The decoded value with every type made explicit: `1`, `1.0`, `True` and `-0.0` differ."""
    if isinstance(value, Telemetry):
        return ("Telemetry", typed(msgspec.structs.asdict(value)))
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((k, typed(v)) for k, v in value.items()), key=str)))
    if isinstance(value, list):
        return ("list", tuple(typed(item) for item in value))
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, datetime):
        return ("datetime", value.isoformat())
    return (type(value).__name__, value)


def reserialise(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in a random order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: reserialise(v, rng) for k, v in items}
    if isinstance(value, list):
        return [reserialise(item, rng) for item in value]
    return value


# --- fixed vectors ---------------------------------------------------------------------------


def test_canonical_form_is_pinned() -> None:
    # Stored ids deduplicate replays across releases: this format must never change silently.
    message = Telemetry(
        ts=5, metrics={"b": 1.0, "a": True}, events=[{"z": {"y": 1, "x": 2}, "type": "T"}]
    )
    canonical = b'{"events":[{"type":"T","z":{"x":2,"y":1}}],"metrics":{"a":true,"b":1.0},"ts":5}'
    assert canonical_bytes(message) == canonical
    assert (
        telemetry_event_id("dev-1", message) == hashlib.sha256(b"dev-1\n" + canonical).hexdigest()
    )


def test_absent_and_null_optional_fields_give_the_same_id() -> None:
    explicit = decode_telemetry(b'{"ts":5,"seq":null,"metrics":{"a":1},"events":null}')
    assert telemetry_event_id("d", explicit) == telemetry_event_id(
        "d", Telemetry(ts=5, metrics={"a": 1})
    )


def test_offsets_of_the_same_instant_give_the_same_id() -> None:
    plus_two = decode_telemetry(b'{"ts":"2024-01-01T02:00:00+02:00","metrics":{"a":1}}')
    zulu = decode_telemetry(b'{"ts":"2024-01-01T00:00:00Z","metrics":{"a":1}}')
    assert telemetry_event_id("d", plus_two) == telemetry_event_id("d", zulu)


LOOK_ALIKES: list[Any] = [0, 0.0, -0.0, False, "0", 1, 1.0, True, "1", "", "true"]


def test_values_that_compare_equal_in_python_give_distinct_ids() -> None:
    messages = [Telemetry(ts=0, metrics={"a": value}) for value in LOOK_ALIKES]
    messages += [Telemetry(ts=0, events=[{"type": "T", "v": value}]) for value in LOOK_ALIKES]
    messages += [Telemetry(ts=0, events=[{"type": "T", "v": [value]}]) for value in LOOK_ALIKES]
    messages += [Telemetry(ts=0, events=[{"type": "T", "v": None}])]
    messages += [
        Telemetry(ts=0, events=[{"type": "T"}]),
        Telemetry(ts=0, events=[{"type": "T"}] * 2),
    ]
    messages += [Telemetry(ts=datetime(1970, 1, 1, tzinfo=UTC), metrics={"a": 0})]
    messages += [Telemetry(ts=0, seq=0, metrics={"a": 0}), Telemetry(ts=0, seq=1, metrics={"a": 0})]
    messages += [Telemetry(ts=0, metrics={"a": 0}, events=[{"type": "T"}])]
    ids = {telemetry_event_id("d", message) for message in messages}
    assert len(ids) == len(messages)


@pytest.mark.parametrize("device_id", ["", "a\nb", "a/b", "x" * 65])
def test_invalid_device_id_is_refused(device_id: str) -> None:
    with pytest.raises(InvalidDeviceIdError):
        telemetry_event_id(device_id, Telemetry(ts=1, metrics={"a": 1}))


# --- properties ------------------------------------------------------------------------------


@given(DEVICE_IDS, telemetry())
def test_id_is_64_lowercase_hex(device_id: str, message: Telemetry) -> None:
    assert re.fullmatch("[0-9a-f]{64}", telemetry_event_id(device_id, message))


@given(DEVICE_IDS, telemetry(), st.sampled_from(Encoding))
def test_id_survives_an_encode_decode_round_trip(
    device_id: str, message: Telemetry, encoding: Encoding
) -> None:
    decoded = decode_telemetry(encode_telemetry(message, encoding), encoding)
    assert telemetry_event_id(device_id, decoded) == telemetry_event_id(device_id, message)


@given(DEVICE_IDS, telemetry())
def test_json_and_msgpack_forms_give_the_same_id(device_id: str, message: Telemetry) -> None:
    from_json = decode_telemetry(encode_telemetry(message, Encoding.JSON), Encoding.JSON)
    packed = encode_telemetry(from_json, Encoding.MSGPACK)
    from_msgpack = decode_telemetry(packed, Encoding.MSGPACK)
    assert telemetry_event_id(device_id, from_json) == telemetry_event_id(device_id, from_msgpack)


JSON_LAYOUTS = st.fixed_dictionaries(
    {
        "indent": st.sampled_from([None, 0, 2, "\t"]),
        "separators": st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\r\n ")]),
        "ensure_ascii": st.booleans(),
    }
)


@given(DEVICE_IDS, telemetry(), st.randoms(use_true_random=False), JSON_LAYOUTS)
def test_key_order_whitespace_and_escapes_do_not_change_the_id(
    device_id: str, message: Telemetry, rng: random.Random, layout: dict[str, Any]
) -> None:
    value = reserialise(json.loads(encode_telemetry(message)), rng)
    redelivered = decode_telemetry(json.dumps(value, **layout).encode())
    assert telemetry_event_id(device_id, redelivered) == telemetry_event_id(device_id, message)


@given(telemetry())
def test_canonical_bytes_are_a_fixed_point(message: Telemetry) -> None:
    canonical = canonical_bytes(message)
    assert canonical_bytes(decode_telemetry(canonical)) == canonical


SMALL_TIMESTAMPS: st.SearchStrategy[int | datetime] = st.sampled_from(
    [0, 1, datetime(1970, 1, 1, tzinfo=UTC)]
)
SMALL_TELEMETRY = telemetry(
    timestamps=SMALL_TIMESTAMPS,
    seqs=st.integers(0, 1),
    names=st.sampled_from(["a", "b"]),
    metric_values=SMALL_VALUES,
    event_values=SMALL_VALUES | st.lists(SMALL_VALUES, max_size=2),
)


def replacement_for(draw: st.DrawFn, current: object) -> object:
    """Mostly a value Python finds equal to `current` (`1`, `1.0`, `True`), else any value."""
    look_alikes: list[object] = [
        v for v in LOOK_ALIKES if v == current and type(v) is not type(current)
    ]
    prefer_look_alike = draw(st.booleans())
    if look_alikes and prefer_look_alike:
        return draw(st.sampled_from(look_alikes))
    return draw(SMALL_VALUES)


@st.composite
def near_pairs(draw: st.DrawFn) -> tuple[Telemetry, Telemetry]:
    """A message and a copy with at most one field or value replaced, often by a look-alike."""
    a = draw(SMALL_TELEMETRY)
    fields = msgspec.structs.asdict(a)
    targets = ["ts", "seq"] + ["metric"] * bool(a.metrics) + ["event"] * bool(a.events)
    target = draw(st.sampled_from(targets))
    if target == "ts":
        fields["ts"] = draw(SMALL_TIMESTAMPS)
    elif target == "seq":
        fields["seq"] = draw(st.none() | st.integers(0, 1))
    elif target == "metric" and a.metrics:
        name = draw(st.sampled_from(sorted(a.metrics)))
        fields["metrics"] = {**a.metrics, name: replacement_for(draw, a.metrics[name])}
    elif target == "event" and a.events:
        index = draw(st.integers(0, len(a.events) - 1))
        event = a.events[index]
        changed = {**event, "v": replacement_for(draw, event.get("v"))}
        fields["events"] = [changed if i == index else e for i, e in enumerate(a.events)]
    return a, Telemetry(**fields)


@settings(max_examples=500)
@given(near_pairs(), st.sampled_from(["a", "a", "a", "b"]))
def test_same_id_exactly_for_the_same_device_and_decoded_value(
    pair: tuple[Telemetry, Telemetry], other_device: str
) -> None:
    a, b = pair
    same_value = ("a", typed(a)) == (other_device, typed(b))
    assert (telemetry_event_id("a", a) == telemetry_event_id(other_device, b)) == same_value


@given(DEVICE_IDS, telemetry(), DEVICE_IDS, telemetry())
def test_distinct_canonical_bytes_or_devices_give_distinct_ids(
    device_a: str, a: Telemetry, device_b: str, b: Telemetry
) -> None:
    if (device_a, canonical_bytes(a)) != (device_b, canonical_bytes(b)):
        assert telemetry_event_id(device_a, a) != telemetry_event_id(device_b, b)
    if typed(a) != typed(b):
        assert canonical_bytes(a) != canonical_bytes(b)
