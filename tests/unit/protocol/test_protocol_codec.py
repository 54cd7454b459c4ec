from __future__ import annotations

import pickle
import random
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest

from protocol import (
    MAX_EVENTS,
    MAX_METRICS,
    MAX_STRING_BYTES,
    CommandReceipt,
    DecodeError,
    DownlinkCommand,
    Encoding,
    Presence,
    ReceiptResult,
    ResultCode,
    Telemetry,
    decode_command,
    decode_presence,
    decode_receipt,
    decode_telemetry,
    encode_command,
    encode_presence,
    encode_receipt,
    encode_telemetry,
    micros,
)
from protocol.messages import MAX_EPOCH_MS


def invalid(payload: bytes | dict[str, Any], encoding: Encoding = Encoding.JSON) -> str:
    """Decode a payload expected to break the schema; return the error detail."""
    if isinstance(payload, dict):
        payload = (
            msgspec.json.encode(payload)
            if encoding is Encoding.JSON
            else msgspec.msgpack.encode(payload)
        )
    with pytest.raises(DecodeError) as info:
        decode_telemetry(payload, encoding)
    assert info.value.code == "INVALID", info.value
    assert str(info.value) == f"INVALID: {info.value.detail}"
    return info.value.detail


# --- telemetry: valid messages ---------------------------------------------------------------


def test_decodes_epoch_ms_metrics_and_events() -> None:
    message = decode_telemetry(
        b'{"ts": 1700000000123, "seq": 7, "metrics": {"temp": 21.5, "count": 3, "door": true,'
        b' "mode": "eco"}, "events": [{"type": "DOOR_OPEN", "zone": {"id": 3}, "tags": ["a"]}]}'
    )
    assert message.ts == 1700000000123
    assert message.seq == 7
    assert message.metrics == {"temp": 21.5, "count": 3, "door": True, "mode": "eco"}
    assert message.events == [{"type": "DOOR_OPEN", "zone": {"id": 3}, "tags": ["a"]}]
    assert message.event_types() == ("DOOR_OPEN",)
    assert message.timestamp() == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)


def test_metric_union_keeps_bool_int_float_and_str_apart() -> None:
    message = decode_telemetry(b'{"ts":0,"metrics":{"b":true,"i":1,"f":1.0,"s":"1","z":-0.0}}')
    assert message.metrics is not None
    assert [type(v) for v in message.metrics.values()] == [bool, int, float, str, float]


def test_rfc3339_timestamp_is_normalised_to_utc() -> None:
    message = decode_telemetry(b'{"ts": "2024-03-01T12:30:00.5+02:00", "metrics": {"a": 1}}')
    assert message.ts == datetime(2024, 3, 1, 10, 30, 0, 500000, tzinfo=UTC)
    assert isinstance(message.ts, datetime)
    assert message.ts.tzinfo is UTC
    assert message.timestamp() == message.ts


def test_events_alone_are_enough() -> None:
    message = decode_telemetry(b'{"ts": 0, "metrics": {}, "events": [{"type": "X"}]}')
    assert message.event_types() == ("X",)


def test_epoch_ms_bounds() -> None:
    assert decode_telemetry(b'{"ts":0,"metrics":{"a":1}}').timestamp() == datetime(
        1970, 1, 1, tzinfo=UTC
    )
    last = decode_telemetry(b'{"ts":253370764799999,"metrics":{"a":1}}')
    assert last.timestamp() == datetime(9998, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    assert invalid(b'{"ts":-1,"metrics":{"a":1}}') == "Expected `int` >= 0 - at `$.ts`"
    assert invalid(b'{"ts":253370764800000,"metrics":{"a":1}}') == (
        "Expected `int` <= 253370764799999 - at `$.ts`"
    )


_TIME_RANGE = (
    "Expected a time from 1970-01-01T00:00:00Z up to, not including, 9999-01-01T00:00:00Z"
    " - at `$.ts`"
)


@pytest.mark.parametrize(
    "ts",
    [
        # asyncpg stores these two as PostgreSQL's infinity and -infinity (issue: a poison
        # message that crash-looped the daemon).
        "9999-12-31T23:59:59.999999Z",
        "0001-01-01T00:00:00Z",
        "0001-01-01T00:00:00.000001Z",
        "9999-01-01T00:00:00Z",
        "9999-01-01T01:00:00+01:00",  # 9999-01-01T00:00Z: the first time refused
        "1969-12-31T23:59:59.999999Z",
        "1970-01-01T00:30:00+01:00",  # 1969-12-31T23:30Z
    ],
)
def test_times_outside_the_range_every_part_can_hold_are_invalid(ts: str) -> None:
    payload = b'{"ts":"%s","metrics":{"a":1}}' % ts.encode()
    assert invalid(payload) == _TIME_RANGE
    packed = msgspec.msgpack.encode({"ts": ts, "metrics": {"a": 1}})
    with pytest.raises(DecodeError) as caught:
        decode_telemetry(packed, Encoding.MSGPACK)
    assert (caught.value.code, caught.value.detail) == ("INVALID", _TIME_RANGE)


@pytest.mark.parametrize(
    "ts",
    [
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC),
    ],
)
def test_messagepack_timestamps_outside_the_range_are_invalid(ts: datetime) -> None:
    # The timestamp extension (type -1), not a string: the same range.
    packed = msgspec.msgpack.encode({"ts": ts, "metrics": {"a": 1}})
    with pytest.raises(DecodeError) as caught:
        decode_telemetry(packed, Encoding.MSGPACK)
    assert (caught.value.code, caught.value.detail) == ("INVALID", _TIME_RANGE)


@pytest.mark.parametrize(
    ("ts", "expected"),
    [
        ("1970-01-01T00:00:00Z", datetime(1970, 1, 1, tzinfo=UTC)),
        ("9998-12-31T23:59:59.999999Z", datetime(9998, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)),
        ("9999-01-01T00:59:59+01:00", datetime(9998, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ],
)
def test_times_at_the_ends_of_the_range_are_kept(ts: str, expected: datetime) -> None:
    payload = b'{"ts":"%s","metrics":{"a":1}}' % ts.encode()
    assert decode_telemetry(payload).timestamp() == expected


def test_limits_are_inclusive() -> None:
    metrics: dict[str, object] = {f"m{i}": i for i in range(MAX_METRICS)}
    metrics["m0"] = "x" * MAX_STRING_BYTES
    events = [{"type": "E"}] * MAX_EVENTS
    message = decode_telemetry(msgspec.json.encode({"ts": 1, "metrics": metrics, "events": events}))
    assert message.metrics is not None
    assert len(message.metrics) == MAX_METRICS
    assert len(message.event_types()) == MAX_EVENTS


# --- telemetry: each DecodeError code with its detail ----------------------------------------


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (b'{"ts": 1, "metrics": {"a": 1}', "Input data was truncated"),
        (b"not json", "JSON is malformed: invalid character (byte 4)"),
        (b'{"ts": 1, "metrics": {"a": "\xff"}}', "Invalid UTF-8 encoded string"),
        (b"", "Input data was truncated"),
        (b'{"ts": 1, "metrics": {"a": 1}} x', "JSON is malformed: trailing characters (byte 32)"),
    ],
)
def test_malformed_json(payload: bytes, detail: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_telemetry(payload)
    assert (info.value.code, info.value.detail) == ("MALFORMED", detail)


def test_malformed_msgpack() -> None:
    with pytest.raises(DecodeError) as info:
        decode_telemetry(b"\xc1", Encoding.MSGPACK)
    assert info.value.code == "MALFORMED"
    assert info.value.detail == "MessagePack data is malformed: invalid opcode '\\xc1' (byte 0)"


def test_deep_nesting_is_malformed_not_a_crash() -> None:
    depth = 5000
    payload = b'{"ts":1,"events":[{"type":"A","x":' + b"[" * depth + b"]" * depth + b"}]}"
    with pytest.raises(DecodeError) as info:
        decode_telemetry(payload)
    assert info.value.code == "MALFORMED"
    assert "nesting too deep" in info.value.detail


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (b'{"ts":1,"seq":"7","metrics":{"a":1}}', "Expected `int | null`, got `str` - at `$.seq`"),
        (b'{"ts":1,"seq":-1,"metrics":{"a":1}}', "Expected `int` >= 0 - at `$.seq`"),
        (b'{"ts":1.5,"metrics":{"a":1}}', "Expected `int | datetime`, got `float` - at `$.ts`"),
        (b'{"ts":1,"metrics":{"a":1},"extra":1}', "Object contains unknown field `extra`"),
        (b'{"metrics":{"a":1}}', "Object missing required field `ts`"),
        (b"[]", "Expected `object`, got `array`"),
        (b'{"ts":1}', "Expected a non-empty `metrics` or `events` - at `$`"),
        (
            b'{"ts":1,"metrics":{},"events":[]}',
            "Expected a non-empty `metrics` or `events` - at `$`",
        ),
        (b'{"ts":1,"metrics":null}', "Expected a non-empty `metrics` or `events` - at `$`"),
        (
            b'{"ts":"2024-01-01T00:00:00","metrics":{"a":1}}',
            "Expected `datetime` with a timezone component - at `$.ts`",
        ),
        (
            b'{"ts":"yesterday","metrics":{"a":1}}',
            "Invalid RFC3339 encoded datetime - at `$.ts`",
        ),
        (
            b'{"ts":"0001-01-01T00:00:00+01:00","metrics":{"a":1}}',
            "`datetime` is out of range once converted to UTC - at `$.ts`",
        ),
        (
            b'{"ts":1,"events":[{"kind":"DOOR_OPEN"}]}',
            "Object missing required field `type` - at `$.events[0]`",
        ),
        (
            b'{"ts":1,"events":[{"type":"OK"},{"type":7}]}',
            r"Expected `str` matching regex '^[A-Za-z0-9_.:-]{1,64}\\Z' - at `$.events[1].type`",
        ),
        (
            b'{"ts":1,"events":[{"type":"DOOR OPEN"}]}',
            r"Expected `str` matching regex '^[A-Za-z0-9_.:-]{1,64}\\Z' - at `$.events[0].type`",
        ),
        (b'{"ts":1,"events":["DOOR_OPEN"]}', "Expected `object`, got `str` - at `$.events[0]`"),
        (
            b'{"ts":1,"metrics":{"bad name":1}}',
            r"Expected `str` matching regex '^[A-Za-z0-9_.:-]{1,64}\\Z' - at `key` in `$.metrics`",
        ),
        (
            b'{"ts":1,"metrics":{"a":[1]}}',
            "Expected `bool | int | float | str`, got `array` - at `$.metrics[...]`",
        ),
        (
            b'{"ts":1,"metrics":{"a":9223372036854775808}}',
            "Expected `int` <= 9223372036854775807 - at `$.metrics[...]`",
        ),
        (b'{"ts":1,"metrics":{"a":1e400}}', "Number out of range - at `$.metrics[...]`"),
        (
            b'{"ts":1,"metrics":{"a":"x\\u0000"}}',
            "Expected `str` without NUL characters - at `$.metrics['a']`",
        ),
        (
            b'{"ts":1,"events":[{"type":"A","n":[1,{"k":"\\u0000"}]}]}',
            "Expected `str` without NUL characters - at `$.events[0].n[1].k`",
        ),
        (
            b'{"ts":1,"events":[{"type":"A","n":-9223372036854775809}]}',
            "Expected `int` in the int64 range - at `$.events[0].n`",
        ),
    ],
)
def test_invalid_telemetry_json(payload: bytes, detail: str) -> None:
    assert invalid(payload) == detail


_NAMES = ["temp", "a.b:c-d_9", "x" * 64, "x" * 65, "", "bad name", "tëmp", "a/b", "temp\n"]


@pytest.mark.parametrize("encoding", [Encoding.JSON, Encoding.MSGPACK])
def test_the_decoder_says_what_telemetrys_own_type_says(encoding: Encoding) -> None:
    """decode_telemetry reads a payload as WireTelemetry and checks metric names once each
    (messages.wire_telemetry); whatever the names, valid or not, seen before or not, it
    answers what decoding `Telemetry` itself (its name pattern included) answers."""
    own = (msgspec.json if encoding is Encoding.JSON else msgspec.msgpack).Decoder(Telemetry)
    encode = (msgspec.json if encoding is Encoding.JSON else msgspec.msgpack).encode
    rng = random.Random(5)
    for _ in range(300):
        names = rng.sample(_NAMES, rng.randint(1, 3))
        payload = encode({"ts": rng.choice([1, 2**60]), "metrics": dict.fromkeys(names, 1.5)})
        try:
            expected: Telemetry | tuple[str, str] = own.decode(payload)
        except msgspec.ValidationError as exc:
            expected = ("INVALID", str(exc))
        try:
            got: Telemetry | tuple[str, str] = decode_telemetry(payload, encoding)
        except DecodeError as exc:
            got = (exc.code, exc.detail)
        assert got == expected, names


def test_names_found_valid_are_remembered_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound, names are checked every time and nothing more is kept."""
    from protocol import messages

    monkeypatch.setattr(messages, "_valid_names", set())
    monkeypatch.setattr(messages, "_VALID_NAMES_MAX", 3)
    for n in range(5):
        decode_telemetry(encode_telemetry(Telemetry(ts=1, metrics={f"m{n}": 1})))
    assert messages._valid_names == {"m0", "m1", "m2"}
    assert invalid({"ts": 1, "metrics": {"m0": 1, "m 9": 1}}).endswith("at `key` in `$.metrics`")


def test_too_many_metrics() -> None:
    metrics = {f"m{i}": i for i in range(MAX_METRICS + 1)}
    assert invalid({"ts": 1, "metrics": metrics}) == (
        f"Expected `object` of length <= {MAX_METRICS} - at `$.metrics`"
    )


def test_too_many_events() -> None:
    events = [{"type": "E"}] * (MAX_EVENTS + 1)
    assert invalid({"ts": 1, "events": events}) == (
        f"Expected `array` of length <= {MAX_EVENTS} - at `$.events`"
    )


def test_string_metric_too_long() -> None:
    assert invalid({"ts": 1, "metrics": {"a": "é" * (MAX_STRING_BYTES + 1)}}) == (
        f"Expected `str` of length <= {MAX_STRING_BYTES} - at `$.metrics[...]`"
    )


def test_metric_name_too_long() -> None:
    assert "at `key` in `$.metrics`" in invalid({"ts": 1, "metrics": {"x" * 65: 1}})


def test_event_nesting_limit() -> None:
    deep: Any = 1
    for _ in range(31):  # the event object itself is the first of the 32 levels
        deep = [deep]
    assert decode_telemetry(msgspec.json.encode({"ts": 1, "events": [{"type": "A", "x": deep}]}))
    detail = invalid({"ts": 1, "events": [{"type": "A", "x": [deep]}]})
    assert detail.startswith("Nesting deeper than 32 levels - at `$.events[0].x")


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        (b"raw", "got `bytes` - at `$.events[0].v`"),
        (msgspec.msgpack.Ext(5, b"x"), "got `Ext` - at `$.events[0].v`"),
        (datetime(2024, 1, 1, tzinfo=UTC), "got `datetime` - at `$.events[0].v`"),
        (float("nan"), "Expected a finite `float` - at `$.events[0].v`"),
        (float("-inf"), "Expected a finite `float` - at `$.events[0].v`"),
        (2**64 - 1, "Expected `int` in the int64 range - at `$.events[0].v`"),
        ({1: 2}, "Expected object keys of type `str` without NUL - at `$.events[0].v`"),
    ],
)
def test_msgpack_event_values_without_a_faithful_json_form(value: object, detail: str) -> None:
    payload = {"ts": 1, "events": [{"type": "A", "v": value}]}
    assert invalid(payload, Encoding.MSGPACK).endswith(detail)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_msgpack_non_finite_metric(value: float) -> None:
    assert invalid({"ts": 1, "metrics": {"a": value}}, Encoding.MSGPACK) == (
        "Expected a finite `float` - at `$.metrics['a']`"
    )


def test_msgpack_naive_datetime_is_invalid() -> None:
    # msgspec encodes a naive datetime as an RFC 3339 string without offset.
    payload = {"ts": datetime(2024, 1, 1), "metrics": {"a": 1}}
    assert invalid(payload, Encoding.MSGPACK) == (
        "Expected `datetime` with a timezone component - at `$.ts`"
    )


def test_python_construction_rejects_naive_datetime() -> None:
    with pytest.raises(ValueError, match="timezone"):
        Telemetry(ts=datetime(2024, 1, 1), metrics={"a": 1})


# --- size limit ------------------------------------------------------------------------------


def test_oversized_is_checked_before_parsing() -> None:
    payload = b'{"ts":1,"metrics":{"a":1}}'
    assert decode_telemetry(payload, max_bytes=len(payload)).metrics == {"a": 1}
    with pytest.raises(DecodeError) as info:
        decode_telemetry(b"x" + payload, max_bytes=len(payload))
    assert info.value.code == "OVERSIZED"
    assert info.value.detail == f"payload is {len(payload) + 1} bytes, the limit is {len(payload)}"
    with pytest.raises(DecodeError, match="OVERSIZED"):
        decode_receipt(b'{"commandId":1,"result":"ACKED"}', max_bytes=10)


def test_decode_error_is_a_value_error_and_pickles() -> None:
    error = DecodeError("INVALID", "why - at `$`")
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))  # noqa: S301 - our own bytes
    assert (copy.code, copy.detail, str(copy)) == ("INVALID", "why - at `$`", str(error))


# --- round trips -----------------------------------------------------------------------------


MESSAGES = [
    Telemetry(ts=1, metrics={"a": 1}),
    Telemetry(ts=0, seq=0, metrics={"b": True, "i": -(2**63), "f": -0.0, "s": ""}),
    Telemetry(
        ts=datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=timezone(timedelta(hours=-5))),
        seq=2**63 - 1,
        events=[{"type": "A.b:c-d_e", "x": {"y": [1, 2.5, None, "s", {"z": False}]}}],
    ),
]


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("message", MESSAGES)
def test_telemetry_round_trip(message: Telemetry, encoding: Encoding) -> None:
    assert decode_telemetry(encode_telemetry(message, encoding), encoding) == message


def test_msgpack_datetime_uses_the_timestamp_extension_and_accepts_strings() -> None:
    message = Telemetry(ts=datetime(2024, 1, 1, tzinfo=UTC), metrics={"a": 1})
    packed = encode_telemetry(message, Encoding.MSGPACK)
    assert b"\xd6\xff" in packed  # fixext 4, type -1: the timestamp extension
    as_string = msgspec.msgpack.encode({"ts": "2024-01-01T01:00:00+01:00", "metrics": {"a": 1}})
    assert decode_telemetry(as_string, Encoding.MSGPACK) == message


def test_absent_optional_fields_are_not_encoded() -> None:
    assert encode_telemetry(Telemetry(ts=5, metrics={"a": 1})) == b'{"ts":5,"metrics":{"a":1}}'


# --- receipts and commands -------------------------------------------------------------------


def test_receipt_without_claim_generation_decodes_with_none() -> None:
    receipt = decode_receipt(b'{"commandId": 12, "result": "ACKED", "resultCode": 0}')
    assert receipt == CommandReceipt(command_id=12, result=ReceiptResult.ACKED, result_code=0)
    assert receipt.claim_generation is None
    assert receipt.result_code == ResultCode.SUCCESS


def test_receipt_wire_names_round_trip() -> None:
    receipt = CommandReceipt(
        command_id=1,
        claim_generation=3,
        node_id="gw-1",
        result=ReceiptResult.FAILED,
        result_code=ResultCode.EXECUTION_FAILED,
        raw_result_code="E42",
        raw_ack="a1b2",
    )
    wire = msgspec.json.decode(encode_receipt(receipt))
    assert wire == {
        "commandId": 1,
        "claimGeneration": 3,
        "nodeId": "gw-1",
        "result": "FAILED",
        "resultCode": 3,
        "rawResultCode": "E42",
        "rawAck": "a1b2",
    }
    for encoding in Encoding:
        assert decode_receipt(encode_receipt(receipt, encoding), encoding) == receipt


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (b'{"commandId":1,"result":"DONE"}', "Invalid enum value 'DONE' - at `$.result`"),
        (b'{"commandId":1}', "Object missing required field `result`"),
        (b'{"commandId":1,"result":"ACKED","x":1}', "Object contains unknown field `x`"),
        (b'{"command_id":1,"result":"ACKED"}', "Object contains unknown field `command_id`"),
        (
            b'{"commandId":1,"result":"ACKED","rawResultCode":1.5}',
            "Expected `int | str | null`, got `float` - at `$.rawResultCode`",
        ),
    ],
)
def test_invalid_receipts(payload: bytes, detail: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_receipt(payload)
    assert (info.value.code, info.value.detail) == ("INVALID", detail)


def test_command_wire_names_and_defaults() -> None:
    command = DownlinkCommand(command_id=9, claim_generation=2, node_id="gw-1", name="arm")
    assert msgspec.json.decode(encode_command(command)) == {
        "commandId": 9,
        "claimGeneration": 2,
        "nodeId": "gw-1",
        "name": "arm",
        "params": {},
        "deadline": None,
    }
    minimal = decode_command(b'{"commandId":9,"claimGeneration":2,"nodeId":"gw-1","name":"arm"}')
    assert minimal == command


@pytest.mark.parametrize("encoding", list(Encoding))
def test_command_round_trip(encoding: Encoding) -> None:
    command = DownlinkCommand(
        command_id=9,
        claim_generation=2,
        node_id="gw-1",
        name="set",
        params={"level": 3, "zones": ["a"]},
        deadline=datetime(2030, 1, 1, tzinfo=UTC),
    )
    assert decode_command(encode_command(command, encoding), encoding) == command


def test_command_rejects_naive_deadline() -> None:
    with pytest.raises(DecodeError) as info:
        decode_command(
            b'{"commandId":1,"claimGeneration":1,"nodeId":"n","name":"x",'
            b'"deadline":"2030-01-01T00:00:00"}'
        )
    assert info.value.detail == "Expected `datetime` with a timezone component - at `$.deadline`"


# --- presence --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "presence"),
    [
        (b"online", Presence.ONLINE),
        (b"offline", Presence.OFFLINE),
        (b" online\r\n", Presence.ONLINE),
        (b'"online"', Presence.ONLINE),
        (b'\t"offline"\n', Presence.OFFLINE),
    ],
)
def test_presence_forms(payload: bytes, presence: Presence) -> None:
    assert decode_presence(payload) is presence


@pytest.mark.parametrize(
    "payload",
    [b"", b"ONLINE", b"Online", b"on line", b"'online'", b'" online"', b"1", b"online!",
     b"\xffonline", b'{"status":"online"}', b"online" + b" " * 100],
)  # fmt: skip
def test_presence_rejects_everything_else(payload: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        decode_presence(payload)
    assert info.value.code == "INVALID"
    assert info.value.detail.startswith("expected `online` or `offline`, got b")


def test_presence_encoding() -> None:
    assert encode_presence(Presence.ONLINE) == b"online"
    assert decode_presence(encode_presence(Presence.OFFLINE)) is Presence.OFFLINE


@pytest.mark.parametrize("seed", [0])
def test_an_epoch_milliseconds_timestamp_is_exact_to_the_millisecond_over_the_whole_range(
    seed: int,
) -> None:
    """timestamp() multiplies a one-millisecond timedelta; it must equal the plain sum for
    every accepted value (replay a failure: the seed is in the test id)."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    draw = random.Random(seed)
    for ts in [
        0,
        1,
        999,
        1_767_225_600_123,
        MAX_EPOCH_MS,
        *(draw.randrange(MAX_EPOCH_MS) for _ in range(2000)),
    ]:
        stamp = Telemetry(ts=ts, metrics={"m": 1}).timestamp()
        assert stamp == epoch + timedelta(milliseconds=ts), ts
        assert stamp.tzinfo is UTC


@pytest.mark.parametrize(
    ("at", "expected"),
    [
        (datetime(1970, 1, 1, tzinfo=UTC), 0),
        (datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC), -1),
        (datetime(1, 1, 1, tzinfo=UTC), -62_135_596_800_000_000),
        (datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC), 253_402_300_799_999_999),
        # The same instant at another offset: the same microseconds.
        (
            datetime(2026, 12, 3, 23, 0, 0, 1, tzinfo=timezone(timedelta(hours=-5))),
            1_796_356_800_000_001,
        ),
    ],
)
def test_micros_is_the_exact_microsecond_count_since_the_epoch(at: datetime, expected: int) -> None:
    assert micros(at) == expected
    # Where a float holds it exactly, the float arithmetic agrees.
    if abs(expected) < 2**53:
        assert expected == round(at.timestamp() * 1_000_000)


def test_a_messages_micros_is_its_times_whether_sent_as_milliseconds_or_a_datetime() -> None:
    for ms in (0, 1, 1_796_443_200_123, MAX_EPOCH_MS):
        as_int = Telemetry(ts=ms, metrics={"temp": 1})
        as_datetime = Telemetry(ts=as_int.timestamp(), metrics={"temp": 1})
        assert as_int.micros() == as_datetime.micros() == micros(as_int.timestamp()) == ms * 1000
