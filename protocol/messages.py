"""Message bodies on device topics, with every rule a decoder enforces on them.

Limits that msgspec can state as `Meta` constraints are checked while decoding, with msgspec's
own precise error paths; the rest live in `__post_init__`, whose `ValueError` msgspec reports as
a `ValidationError`. Constructing a struct in Python runs `__post_init__` but not the `Meta`
constraints, as usual with msgspec.
"""

from __future__ import annotations

import enum
import math
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final, TypeAlias

import msgspec
from msgspec import Meta

from protocol.ids import IDENTIFIER_PATTERN

MAX_METRICS: Final = 256
MAX_STRING_BYTES: Final = 1024  # counted in characters, as msgspec's `max_length` does
MAX_EVENTS: Final = 64
# Deeper event values are rejected so that encoding them again (event id, storage) can never
# come near the interpreter's recursion limit, which msgspec's decoder and encoder both honour.
MAX_EVENT_DEPTH: Final = 32
# Device times are accepted from 1970-01-01T00:00:00Z up to, not including,
# 9999-01-01T00:00:00Z. The ends of `datetime`'s own range cannot be kept: asyncpg stores
# 9999-12-31T23:59:59.999999Z and 0001-01-01T00:00:00Z as PostgreSQL's `infinity` and
# `-infinity` and reads them back as naive datetimes, and any arithmetic near them overflows.
# The year of margin below 10000 keeps every window a rule or timer adds to a sample time
# finite; nothing before 1970 is a real device time (an epoch-millisecond time cannot say it).
MIN_TIME: Final = datetime(1970, 1, 1, tzinfo=UTC)
MAX_TIME: Final = datetime(9999, 1, 1, tzinfo=UTC)
# The last millisecond before MAX_TIME, as epoch milliseconds.
MAX_EPOCH_MS: Final = 253_370_764_799_999
# Integers must fit PostgreSQL `bigint` and a MessagePack int64; JSON alone would take any size.
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

MetricValue: TypeAlias = int | float | bool | str

EpochMillis: TypeAlias = Annotated[int, Meta(ge=0, le=MAX_EPOCH_MS)]
AwareDatetime: TypeAlias = Annotated[datetime, Meta(tz=True)]
Timestamp: TypeAlias = EpochMillis | AwareDatetime

_MetricName: TypeAlias = Annotated[str, Meta(pattern=IDENTIFIER_PATTERN)]
_WireMetricValue: TypeAlias = (
    Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
    | float
    | bool
    | Annotated[str, Meta(max_length=MAX_STRING_BYTES)]
)
_Metrics: TypeAlias = Annotated[dict[_MetricName, _WireMetricValue], Meta(max_length=MAX_METRICS)]
# The same with the names left to `wire_telemetry` (see `WireTelemetry`).
_WireMetrics: TypeAlias = Annotated[dict[str, _WireMetricValue], Meta(max_length=MAX_METRICS)]
_Events: TypeAlias = Annotated[list[dict[str, Any]], Meta(max_length=MAX_EVENTS)]
_Seq: TypeAlias = Annotated[int, Meta(ge=0, le=INT64_MAX)]

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
# One millisecond: `_EPOCH + _MILLISECOND * ts` is exact (integer arithmetic) and twice as
# fast as `timedelta(milliseconds=ts)`, whose keyword is parsed on every call (0.22 against
# 0.46 µs, measured here; two calls per message).
_MILLISECOND: Final = timedelta(milliseconds=1)
_MICROSECOND: Final = timedelta(microseconds=1)
_IDENTIFIER_RE: Final = re.compile(IDENTIFIER_PATTERN)


def micros(at: datetime) -> int:
    """An aware time as whole microseconds since 1970-01-01T00:00:00Z: exact (integer arithmetic
    on the datetime's own fields) over its whole range, before 1970 too. What storage writes in
    place of a datetime (cheaper to send) and turns back with its SQL ``from_micros``."""
    return (at - _EPOCH) // _MICROSECOND


class Telemetry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One telemetry message from a device.

    `ts` datetimes are normalised to UTC on construction: the MessagePack timestamp extension
    carries no offset, so only a UTC value survives both encodings unchanged, and the event id
    is computed from the decoded value. Absent fields are omitted when encoding, so adding an
    optional field later does not change the event id of messages that do not use it.
    """

    ts: Timestamp
    seq: _Seq | None = None
    metrics: _Metrics | None = None
    events: _Events | None = None

    def __post_init__(self) -> None:
        if not self.metrics and not self.events:
            raise ValueError("Expected a non-empty `metrics` or `events` - at `$`")
        if isinstance(self.ts, datetime):
            msgspec.structs.force_setattr(self, "ts", _to_utc(self.ts))
        if self.metrics:
            _check_metric_values(self.metrics)
        if self.events:
            _check_events(self.events)

    def timestamp(self) -> datetime:
        """The message time as an aware UTC datetime."""
        if isinstance(self.ts, datetime):
            return self.ts.astimezone(UTC)
        return _EPOCH + _MILLISECOND * self.ts

    def micros(self) -> int:
        """The message time as whole microseconds since 1970-01-01T00:00:00Z (`micros`)."""
        ts = self.ts
        if type(ts) is int:
            return ts * 1000
        return micros(self.timestamp())

    def event_types(self) -> tuple[str, ...]:
        return tuple(event["type"] for event in self.events or ())


class WireTelemetry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A telemetry payload as decoding reads it, before it becomes a `Telemetry`
    (`wire_telemetry`): `Telemetry`'s fields and constraints, but metric names are checked
    afterwards. msgspec checks a `pattern` with a regular-expression search per name, per
    message (1.5 µs of a 3 µs decode for two metrics, measured here); a fleet sends the same
    few names over and over, and `wire_telemetry` checks each name once. Every other decoding
    of `Telemetry` (vendor mappings, replay) keeps its pattern."""

    ts: Timestamp
    seq: _Seq | None = None
    metrics: _WireMetrics | None = None
    events: _Events | None = None


# Metric names found valid (by IDENTIFIER_PATTERN, as `Telemetry`'s own type checks them), up
# to this many; past it a name not among them is checked every time (bounded memory whatever
# names arrive).
_VALID_NAMES_MAX: Final = 4096
_valid_names: set[str] = set()


def wire_telemetry(wire: WireTelemetry) -> Telemetry:
    """The `Telemetry` of a decoded payload, or ValueError with the message `Telemetry`'s own
    decoding gives (its metric names checked here, then `Telemetry.__post_init__`)."""
    metrics = wire.metrics
    if metrics:
        valid = _valid_names
        for name in metrics:
            if name not in valid:
                if _IDENTIFIER_RE.fullmatch(name) is None:
                    raise ValueError(
                        f"Expected `str` matching regex {IDENTIFIER_PATTERN!r}"
                        " - at `key` in `$.metrics`"
                    )
                if len(valid) < _VALID_NAMES_MAX:
                    valid.add(name)
    return Telemetry(wire.ts, wire.seq, metrics, wire.events)


def _to_utc(ts: datetime) -> datetime:
    if ts.utcoffset() is None:
        raise ValueError("Expected `datetime` with a timezone component - at `$.ts`")
    try:
        utc = ts.astimezone(UTC)
    except OverflowError:
        raise ValueError("`datetime` is out of range once converted to UTC - at `$.ts`") from None
    if not MIN_TIME <= utc < MAX_TIME:
        raise ValueError(
            "Expected a time from 1970-01-01T00:00:00Z up to, not including, "
            "9999-01-01T00:00:00Z - at `$.ts`"
        )
    return utc


def _check_metric_values(metrics: dict[str, MetricValue]) -> None:
    for name, value in metrics.items():
        # JSON has no NaN/Infinity (msgspec would encode them as `null`), so a MessagePack
        # message carrying one could not be stored or re-encoded faithfully.
        if type(value) is float and not math.isfinite(value):
            raise ValueError(f"Expected a finite `float` - at `$.metrics[{name!r}]`")
        # PostgreSQL `jsonb` rejects U+0000 in text; refuse it here, not mid-batch in storage.
        if type(value) is str and "\x00" in value:
            raise ValueError(f"Expected `str` without NUL characters - at `$.metrics[{name!r}]`")


def _check_events(events: list[dict[str, Any]]) -> None:
    for index, event in enumerate(events):
        path = f"$.events[{index}]"
        event_type = event.get("type")
        if event_type is None:
            raise ValueError(f"Object missing required field `type` - at `{path}`")
        if not isinstance(event_type, str) or _IDENTIFIER_RE.fullmatch(event_type) is None:
            raise ValueError(
                f"Expected `str` matching regex {IDENTIFIER_PATTERN!r} - at `{path}.type`"
            )
        _check_json_value(event, path)


def _check_json_value(root: object, root_path: str) -> None:
    """Accept only values that JSON and MessagePack both carry identically.

    A value decoded from MessagePack into `Any` may hold bytes, extension types, timestamps,
    non-string keys, NaN or huge integers; their JSON encodings are lossy or ambiguous (bytes
    become base64 strings, NaN becomes null), which would break the event id and storage.
    """
    stack: list[tuple[object, str, int]] = [(root, root_path, 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, list | dict):
            if depth > MAX_EVENT_DEPTH:
                raise ValueError(f"Nesting deeper than {MAX_EVENT_DEPTH} levels - at `{path}`")
            stack.extend(_children(value, path, depth + 1))
        elif (problem := _scalar_problem(value)) is not None:
            raise ValueError(f"{problem} - at `{path}`")


def _children(
    container: list[object] | dict[object, object], path: str, depth: int
) -> list[tuple[object, str, int]]:
    if isinstance(container, list):
        return [(item, f"{path}[{index}]", depth) for index, item in enumerate(container)]
    children: list[tuple[object, str, int]] = []
    for key, item in container.items():
        if not isinstance(key, str) or "\x00" in key:
            raise ValueError(f"Expected object keys of type `str` without NUL - at `{path}`")
        children.append((item, f"{path}.{key}", depth))
    return children


def _scalar_problem(value: object) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        return "Expected `str` without NUL characters" if "\x00" in value else None
    if isinstance(value, int):
        return None if INT64_MIN <= value <= INT64_MAX else "Expected `int` in the int64 range"
    if isinstance(value, float):
        return None if math.isfinite(value) else "Expected a finite `float`"
    return (
        "Expected a JSON value (null, bool, int, float, str, array, object), "
        f"got `{type(value).__name__}`"
    )


class ResultCode(enum.IntEnum):
    """The standard result codes of a command receipt; vendor codes go to `raw_result_code`."""

    SUCCESS = 0
    UNSUPPORTED = 1
    INVALID_PARAMS = 2
    EXECUTION_FAILED = 3
    DEVICE_BUSY = 4


class ReceiptResult(enum.StrEnum):
    ACKED = "ACKED"
    SENT = "SENT"
    TIMEOUT = "TIMEOUT"
    DEVICE_OFFLINE = "DEVICE_OFFLINE"
    FAILED = "FAILED"


class DownlinkCommand(msgspec.Struct, frozen=True, rename="camel"):
    """A command published by the gateway to `{prefix}/devices/{device_id}/commands`."""

    command_id: int
    claim_generation: int
    node_id: str
    name: str
    params: dict[str, Any] = msgspec.field(default_factory=dict)
    deadline: Timestamp | None = None


# Receipt fields are bounded by the columns they are stored in (bigint ids, integer
# generation and codes): an out-of-range value is a bad receipt, not a database error.
_CommandId = Annotated[int, Meta(ge=1, le=INT64_MAX)]
_Int32 = Annotated[int, Meta(ge=0, le=2**31 - 1)]
_SignedInt32 = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
_SignedInt64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
_ReceiptText = Annotated[str, Meta(max_length=256)]
_RawAck = Annotated[str, Meta(max_length=16384)]


class CommandReceipt(
    msgspec.Struct, frozen=True, rename="camel", forbid_unknown_fields=True, kw_only=True
):
    """A device's answer to a command.

    Keyword-only because `result` is required but follows optional fields in the wire order.
    `claim_generation` may be absent: the gateway rejects such receipts itself
    (CLAIM_GENERATION_REQUIRED), so they must decode rather than dead-letter as INVALID.
    """

    command_id: _CommandId
    claim_generation: _Int32 | None = None
    node_id: _ReceiptText | None = None
    result: ReceiptResult
    result_code: _SignedInt32 | None = None
    raw_result_code: _ReceiptText | _SignedInt64 | None = None
    raw_ack: _RawAck | None = None

    def __post_init__(self) -> None:
        # The gateway stores these as text: PostgreSQL text cannot hold NUL, and a receipt it
        # cannot store must dead-letter here, not fail the batch transaction.
        for name, wire in (
            ("node_id", "nodeId"),
            ("raw_result_code", "rawResultCode"),
            ("raw_ack", "rawAck"),
        ):
            value = getattr(self, name)
            if isinstance(value, str) and "\x00" in value:
                raise ValueError(f"Expected `str` without NUL characters - at `$.{wire}`")


class Presence(enum.StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"
