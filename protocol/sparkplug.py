"""Sparkplug B (Eclipse Sparkplug 3.0) on the wire: topics, protobuf payloads, the host
application's STATE message, and the commands a host sends (NCMD/DCMD).

The payload is Eclipse Tahu's ``sparkplug_b.proto`` (EPL-2.0, vendored with its header as
``protocol/sparkplug_b.proto``) compiled by protobuf's own compiler into
``protocol/sparkplug_b_pb2.py``; the ``protobuf`` runtime parses it. Everything here is pure:
decoding gives plain structs, the state they are judged against lives in PostgreSQL
(``gateway.sparkplug``).

Identity: an edge node is ``{group}/{node}``, a device behind it ``{group}/{node}/{device}``
(docs/sparkplug.md). Each level must match the native id grammar (``protocol.ids``): the
``/`` only ever separates levels, so the ids never collide with native ones, which hold none.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeAlias

import msgspec

from protocol.ids import DEVICE_ID_RE

if TYPE_CHECKING:
    from protocol import sparkplug_b_pb2 as pb

NAMESPACE: Final = "spBv1.0"
STATE: Final = "STATE"
BDSEQ: Final = "bdSeq"
REBIRTH: Final = "Node Control/Rebirth"

# Sparkplug metric names may hold `/` (folders) and spaces; NUL and control characters are
# refused, and names longer than this.
MAX_METRIC_NAME: Final = 256
_METRIC_NAME_RE: Final = re.compile(r"^[^\x00-\x1f\x7f]{1,256}\Z")

SparkplugValue: TypeAlias = int | float | bool | str


class MessageType(enum.StrEnum):
    NBIRTH = "NBIRTH"
    NDEATH = "NDEATH"
    DBIRTH = "DBIRTH"
    DDEATH = "DDEATH"
    NDATA = "NDATA"
    DDATA = "DDATA"
    NCMD = "NCMD"
    DCMD = "DCMD"


_TYPES: Final = {t.value: t for t in MessageType}
_DEVICE_TYPES: Final = frozenset({MessageType.DBIRTH, MessageType.DDEATH, MessageType.DDATA})
BIRTHS: Final = frozenset({MessageType.NBIRTH, MessageType.DBIRTH})
# What a host application consumes; NCMD/DCMD are other hosts' commands.
CONSUMED: Final = frozenset(
    {
        MessageType.NBIRTH,
        MessageType.NDEATH,
        MessageType.DBIRTH,
        MessageType.DDEATH,
        MessageType.NDATA,
        MessageType.DDATA,
    }
)


class DataType(enum.IntEnum):
    """The datatypes of ``sparkplug_b.proto`` (the ones a metric value is read from)."""

    UNKNOWN = 0
    INT8 = 1
    INT16 = 2
    INT32 = 3
    INT64 = 4
    UINT8 = 5
    UINT16 = 6
    UINT32 = 7
    UINT64 = 8
    FLOAT = 9
    DOUBLE = 10
    BOOLEAN = 11
    STRING = 12
    DATETIME = 13
    TEXT = 14
    UUID = 15
    DATASET = 16
    BYTES = 17
    FILE = 18
    TEMPLATE = 19


_KNOWN: Final = frozenset(DataType)
# By plain int: looked up with a payload's datatype as is (no DataType(...) made a metric).
_SIGNED_BITS: Final[dict[int, int]] = {
    int(DataType.INT8): 8, int(DataType.INT16): 16, int(DataType.INT32): 32,
    int(DataType.INT64): 64,
}  # fmt: skip
_STRINGS: Final = frozenset({DataType.STRING, DataType.TEXT, DataType.UUID})
_NOT_COMPARED: Final = frozenset(
    {DataType.DATASET, DataType.BYTES, DataType.FILE, DataType.TEMPLATE}
)


class SparkplugError(ValueError):
    """A topic or payload no Sparkplug host can read; ``code`` is the dead letter's reason."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail

    def __reduce__(self) -> tuple[type[SparkplugError], tuple[str, str]]:
        return (type(self), (self.code, self.detail))


@dataclass(frozen=True, slots=True)
class SparkplugTopic:
    group: str
    type: MessageType
    node: str
    device: str | None = None

    @property
    def node_key(self) -> str:
        """The edge node's id: ``{group}/{node}``."""
        return f"{self.group}/{self.node}"

    @property
    def device_key(self) -> str:
        """Whose data the message carries: the device's id, or the node's."""
        return self.node_key if self.device is None else f"{self.node_key}/{self.device}"


def is_topic(topic: str) -> bool:
    return topic.startswith(NAMESPACE + "/")


def parse_topic(topic: str) -> SparkplugTopic:
    """``spBv1.0/{group}/{type}/{node}[/{device}]``; raises :class:`SparkplugError`
    (``BAD_TOPIC``, ``BAD_DEVICE_ID``)."""
    return _parse_topic(topic)


# A fleet's topics repeat (one a message type per node and device), and every message is
# parsed twice (its ordering key, then its classification): parsing one cost ~2 µs (its
# levels split, each checked by a regex), a look-up here ~0.1. A refused topic raises each
# time (lru_cache keeps no exception). At most ~3.5 MB (8,192 topics of 45 characters,
# tracemalloc); a fleet with more topics than that parses some again.
@functools.lru_cache(maxsize=8192)
def _parse_topic(topic: str) -> SparkplugTopic:
    levels = topic.split("/")
    if len(levels) not in (4, 5) or levels[0] != NAMESPACE:
        raise SparkplugError(
            "BAD_TOPIC", f"expected `{NAMESPACE}/{{group}}/{{type}}/{{node}}[/{{device}}]`"
        )
    group, kind, node = levels[1], levels[2], levels[3]
    message_type = _TYPES.get(kind)
    if message_type is None:
        raise SparkplugError("BAD_TOPIC", f"unknown Sparkplug message type {kind!r}")
    device = levels[4] if len(levels) == 5 else None
    if (device is not None) != (message_type in _DEVICE_TYPES | {MessageType.DCMD}):
        raise SparkplugError(
            "BAD_TOPIC", f"{message_type.value} {'needs' if device is None else 'takes no'} device"
        )
    for what, value in (("group id", group), ("edge node id", node), ("device id", device)):
        if value is not None and DEVICE_ID_RE.fullmatch(value) is None:
            raise SparkplugError(
                "BAD_DEVICE_ID", f"{what} {value!r} must match {DEVICE_ID_RE.pattern}"
            )
    return SparkplugTopic(group, message_type, node, device)


def topic(group: str, message_type: MessageType, node: str, device: str | None = None) -> str:
    for value in (group, node, device):
        if value is not None and DEVICE_ID_RE.fullmatch(value) is None:
            raise ValueError(f"invalid Sparkplug id {value!r}: must match {DEVICE_ID_RE.pattern}")
    tail = "" if device is None else f"/{device}"
    return f"{NAMESPACE}/{group}/{message_type.value}/{node}{tail}"


def split_device_key(device_id: str) -> tuple[str, str, str | None] | None:
    """``(group, node, device)`` of a Sparkplug id (``{group}/{node}[/{device}]``), None for
    anything else (a native id holds no `/`)."""
    levels = device_id.split("/")
    if len(levels) not in (2, 3) or any(DEVICE_ID_RE.fullmatch(level) is None for level in levels):
        return None
    return levels[0], levels[1], levels[2] if len(levels) == 3 else None


def is_device_key(device_id: str) -> bool:
    return split_device_key(device_id) is not None


def state_topic(host_id: str) -> str:
    if DEVICE_ID_RE.fullmatch(host_id) is None:
        raise ValueError(
            f"invalid host application id {host_id!r}: must match {DEVICE_ID_RE.pattern}"
        )
    return f"{NAMESPACE}/{STATE}/{host_id}"


def subscriptions(groups: tuple[str, ...] | list[str]) -> list[str]:
    """The filters a host consuming ``groups`` subscribes to (every group when empty)."""
    if not groups:
        return [f"{NAMESPACE}/#"]
    return [f"{NAMESPACE}/{group}/#" for group in groups]


def state_payload(online: bool, timestamp_ms: int) -> bytes:
    """Sparkplug 3.0's host STATE: ``{"online": …, "timestamp": …}`` (UTF-8 JSON); the Will
    (``online`` false) carries the same timestamp as the birth that follows its CONNECT."""
    return json.dumps({"online": online, "timestamp": timestamp_ms}, separators=(",", ":")).encode()


def parse_state(payload: bytes) -> tuple[bool, int] | None:
    try:
        value = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict):
        return None
    online, timestamp = value.get("online"), value.get("timestamp")
    if (
        not isinstance(online, bool)
        or not isinstance(timestamp, int)
        or isinstance(timestamp, bool)
    ):
        return None
    return online, timestamp


class RawMetric(msgspec.Struct, frozen=True):
    """One metric as the payload has it: the value in whichever field carries it (read with
    the birth's datatype, which a data message may leave out: :func:`metric_value`). A Struct,
    not a frozen dataclass: made for every metric of every message, whose ten fields a frozen
    dataclass sets one ``object.__setattr__`` at a time (1.14 µs a metric, a Struct 0.09)."""

    name: str | None
    alias: int | None
    timestamp: int | None
    datatype: int | None
    is_null: bool
    is_historical: bool
    is_transient: bool
    which: str | None  # the oneof field set: int_value, long_value, ... or None
    raw: object
    properties: dict[str, SparkplugValue | None] = {}


class SparkplugPayload(msgspec.Struct, frozen=True):
    timestamp: int | None
    seq: int | None
    metrics: tuple[RawMetric, ...]

    def bdseq(self) -> int | None:
        for metric in self.metrics:
            if metric.name == BDSEQ and isinstance(metric.raw, int) and not metric.is_null:
                return metric.raw
        return None


def _properties(metric: pb.Payload.Metric) -> dict[str, SparkplugValue | None]:
    if not metric.HasField("properties"):
        return {}
    props = metric.properties
    out: dict[str, SparkplugValue | None] = {}
    for key, value in zip(props.keys, props.values, strict=False):
        which = value.WhichOneof("value")
        if value.is_null or which is None:
            out[key] = None
        elif which in ("int_value", "long_value", "float_value", "double_value"):
            out[key] = _convert(value.type, which, getattr(value, which))
        elif which in ("boolean_value", "string_value"):
            out[key] = getattr(value, which)
        # property sets (nested) are not kept
    return out


@functools.cache
def _wire() -> tuple[type[pb.Payload], type[Exception]]:
    """The compiled schema's Payload and the protobuf runtime's DecodeError, imported at the
    first payload read or written: a gateway without [sparkplug] never loads them (about 4 MB
    resident). Cached: an import statement per message would cost 1.2 us each time."""
    from google.protobuf.message import DecodeError

    from protocol.sparkplug_b_pb2 import Payload

    return Payload, DecodeError


def decode_payload(data: bytes) -> SparkplugPayload:
    """Parse a Sparkplug B payload; raises :class:`SparkplugError` ``MALFORMED``.

    Each metric's fields are read from one ``ListFields()`` (the fields present, proto2's
    presence: an alias of 0 is there, an absent one is not), not a ``HasField`` and an
    attribute each: a third less time a metric with protobuf's upb runtime."""
    payload_type, decode_error = _wire()
    message = payload_type()
    try:
        message.ParseFromString(data)
    except decode_error as exc:
        raise SparkplugError("MALFORMED", f"not a Sparkplug B payload: {exc}") from exc
    values = _value_fields()
    metrics = tuple([_metric(metric, values) for metric in message.metrics])
    return SparkplugPayload(
        message.timestamp if message.HasField("timestamp") else None,
        message.seq if message.HasField("seq") else None,
        metrics,
    )


def _metric(metric: pb.Payload.Metric, values: dict[int, str]) -> RawMetric:
    name = alias = timestamp = datatype = which = None
    raw: object = None
    is_null = is_historical = is_transient = False
    properties: dict[str, SparkplugValue | None] = {}
    for descriptor, value in metric.ListFields():
        number = descriptor.number
        if number in values:
            which, raw = values[number], value
        elif number == _M_ALIAS:
            alias = value
        elif number == _M_NAME:
            name = value
        elif number == _M_TIMESTAMP:
            timestamp = value
        elif number == _M_DATATYPE:
            datatype = value
        elif number == _M_IS_NULL:
            is_null = value
        elif number == _M_IS_HISTORICAL:
            is_historical = value
        elif number == _M_IS_TRANSIENT:
            is_transient = value
        elif number == _M_PROPERTIES:
            properties = _properties(metric)
    if name is not None and _METRIC_NAME_RE.fullmatch(name) is None:
        raise SparkplugError(
            "INVALID", f"metric name {name[:80]!r} is empty, too long or holds control codes"
        )
    return RawMetric(
        name, alias, timestamp, datatype, is_null, is_historical, is_transient, which, raw,
        properties,
    )  # fmt: skip


# The Metric fields decode_payload reads, by number (Sparkplug B's sparkplug_b.proto).
_M_NAME: Final = 1
_M_ALIAS: Final = 2
_M_TIMESTAMP: Final = 3
_M_DATATYPE: Final = 4
_M_IS_HISTORICAL: Final = 5
_M_IS_TRANSIENT: Final = 6
_M_IS_NULL: Final = 7
_M_PROPERTIES: Final = 9


@functools.cache
def _value_fields() -> dict[int, str]:
    """The fields of Metric's ``value`` oneof: number -> name (int_value, ..., as WhichOneof
    names them). Checked against the numbers above: a schema that moved one fails here."""
    metric = _wire()[0].Metric.DESCRIPTOR
    numbers = {
        "name": _M_NAME,
        "alias": _M_ALIAS,
        "timestamp": _M_TIMESTAMP,
        "datatype": _M_DATATYPE,
        "is_historical": _M_IS_HISTORICAL,
        "is_transient": _M_IS_TRANSIENT,
        "is_null": _M_IS_NULL,
        "properties": _M_PROPERTIES,
    }
    for name, number in numbers.items():
        if metric.fields_by_name[name].number != number:
            raise RuntimeError(f"sparkplug_b.proto: Metric.{name} is not field {number}")
    return {f.number: f.name for f in metric.oneofs_by_name["value"].fields}


def _convert(datatype: int | None, which: str, raw: object) -> SparkplugValue | None:
    if which in ("int_value", "long_value") and isinstance(raw, int):
        bits = None if datatype is None else _SIGNED_BITS.get(datatype)
        if bits is not None:
            # Signed integers travel as their two's complement in an unsigned field.
            width = 32 if which == "int_value" else 64
            raw &= (1 << width) - 1
            if raw >= 1 << (width - 1):
                raw -= 1 << width
            elif bits < width and (1 << (bits - 1)) <= raw < (1 << bits):
                raw -= 1 << bits  # sent as the complement of its own width (Int8 -1 as 255)
        return raw
    if which in ("float_value", "double_value") and isinstance(raw, float):
        if not math.isfinite(raw):
            return None
        return _float32(raw) if which == "float_value" else raw
    if which == "boolean_value" and isinstance(raw, bool):
        return raw
    if which == "string_value" and isinstance(raw, str):
        return raw.replace("\x00", "")
    return None


_F32: Final = struct.Struct("<f")


def _float32(value: float) -> float:
    """A 32-bit float (``float_value``: a PLC's REAL, Ignition's Float4) as the shortest
    decimal that is the same 32-bit float, as Java's Float.toString reads it: 80.1 is sent as
    80.09999847412109375, which widened as it is was stored and judged as 80.0999984741211 (a
    rule ``>= 80.1`` never fired on a device reporting 80.1). Nine digits always are the same
    float; a decimal of six digits or fewer that is (a normal float) comes out of the first
    try (``g`` drops the zeros)."""
    packed = _F32.pack(value)
    for digits in (6, 7, 8, 9):
        shortest = float(f"{value:.{digits}g}")
        try:
            if _F32.pack(shortest) == packed:
                return shortest
        except OverflowError:  # rounded past the largest 32-bit float
            continue
    return value


def metric_value(metric: RawMetric, datatype: int | None) -> SparkplugValue | None:
    """The metric's value as a rule can compare it: integers (signed by the datatype), floats,
    booleans, strings, DateTime as epoch milliseconds; None for a null, NaN/±inf, and the
    kinds rules cannot compare (bytes, files, data sets, templates, arrays, property sets)."""
    if metric.is_null or metric.which is None:
        return None
    kind = metric.datatype if metric.datatype is not None else datatype
    if kind is not None and kind not in _KNOWN:
        return None  # arrays (22..34), property sets: not values a rule compares
    if kind in _NOT_COMPARED:
        return None
    return _convert(kind, metric.which, metric.raw)


def message_id(topic_name: str, payload: bytes) -> str:
    """A message's identity (hex SHA-256 of its topic and bytes): a redelivery has the same."""
    return hashlib.sha256(topic_name.encode() + b"\n" + payload).hexdigest()


def encode_rebirth(timestamp_ms: int) -> bytes:
    """An NCMD payload asking an edge node to publish its births again."""
    payload = _wire()[0](timestamp=timestamp_ms)
    metric = payload.metrics.add()
    metric.name = REBIRTH
    metric.timestamp = timestamp_ms
    metric.datatype = DataType.BOOLEAN
    metric.boolean_value = True
    return payload.SerializeToString()


def encode_write(
    timestamp_ms: int, writes: list[tuple[str, int | None, int, SparkplugValue]]
) -> bytes:
    """An NCMD/DCMD payload writing metrics: ``(name, alias, datatype, value)`` each (the name
    is always sent: an edge node need not keep aliases for commands)."""
    payload = _wire()[0](timestamp=timestamp_ms)
    for name, alias, datatype, value in writes:
        metric = payload.metrics.add()
        metric.name = name
        if alias is not None:
            metric.alias = alias
        metric.timestamp = timestamp_ms
        metric.datatype = datatype
        _set_value(metric, datatype, value)
    return payload.SerializeToString()


def _set_value(metric: pb.Payload.Metric, datatype: int, value: SparkplugValue) -> None:
    kind = DataType(datatype) if datatype in _KNOWN else DataType.UNKNOWN
    if kind is DataType.BOOLEAN:
        if not isinstance(value, bool):
            raise ValueError(f"{metric.name}: a Boolean metric takes true or false")
        metric.boolean_value = value
    elif kind in _STRINGS:
        if not isinstance(value, str):
            raise ValueError(f"{metric.name}: a {kind.name.title()} metric takes a string")
        metric.string_value = value
    elif kind in (DataType.FLOAT, DataType.DOUBLE):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{metric.name}: a {kind.name.title()} metric takes a number")
        if kind is DataType.FLOAT:
            metric.float_value = float(value)
        else:
            metric.double_value = float(value)
    elif kind in (
        DataType.INT8, DataType.INT16, DataType.INT32, DataType.UINT8, DataType.UINT16,
        DataType.UINT32,
    ):  # fmt: skip
        metric.int_value = _integer(metric.name, kind, value, 32)
    elif kind in (DataType.INT64, DataType.UINT64, DataType.DATETIME):
        metric.long_value = _integer(metric.name, kind, value, 64)
    else:
        raise ValueError(f"{metric.name}: datatype {datatype} cannot be written by a command")


_RANGES: Final = {
    DataType.INT8: (-(2**7), 2**7 - 1),
    DataType.INT16: (-(2**15), 2**15 - 1),
    DataType.INT32: (-(2**31), 2**31 - 1),
    DataType.INT64: (-(2**63), 2**63 - 1),
    DataType.UINT8: (0, 2**8 - 1),
    DataType.UINT16: (0, 2**16 - 1),
    DataType.UINT32: (0, 2**32 - 1),
    DataType.UINT64: (0, 2**64 - 1),
    DataType.DATETIME: (0, 2**63 - 1),
}


def _integer(name: str, kind: DataType, value: SparkplugValue, width: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: an {kind.name.title()} metric takes an integer")  # noqa: TRY004
    low, high = _RANGES[kind]
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} is out of range for {kind.name.title()}")
    return value & ((1 << width) - 1)  # two's complement for the signed kinds
