"""Mappings compiled: matching a topic, reading a vendor payload into the gateway's own
shapes (a `Telemetry` of a device, a presence value, or a refusal with its reason code), and
rendering a command for a mapped device.

Pure: no I/O. ``compile_mappings`` raises `ConfigError`s naming the key path; a compiled
`Mappings` never raises on a message (a payload it cannot read is a `Refusal`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec

from gateway.domain.errors import ConfigError, config_errors
from gateway.domain.mappings.config import PROFILES, MappingConfig, resolve
from protocol import Telemetry
from protocol.eventid import telemetry_event_id
from protocol.ids import DEVICE_ID_RE, NOT_PORTABLE
from protocol.messages import INT64_MAX, INT64_MIN, MAX_STRING_BYTES

# Reason codes of the dead letters a mapping writes (docs/devices.md).
MAPPING_MALFORMED: Final = "MAPPING_MALFORMED"  # not JSON, or not a JSON object
MAPPING_NO_DEVICE: Final = "MAPPING_NO_DEVICE"  # device_path absent or not a string/number
MAPPING_BAD_DEVICE_ID: Final = "MAPPING_BAD_DEVICE_ID"  # outside the id grammar (refuse)
MAPPING_BAD_TIMESTAMP: Final = "MAPPING_BAD_TIMESTAMP"  # absent, unreadable or out of range
MAPPING_EMPTY: Final = "MAPPING_EMPTY"  # no metric and no event read
MAPPING_INVALID: Final = "MAPPING_INVALID"  # what was read breaks a telemetry limit
MAPPING_UNKNOWN_PRESENCE: Final = "MAPPING_UNKNOWN_PRESENCE"  # neither online nor offline
REASONS: Final = (
    MAPPING_MALFORMED,
    MAPPING_NO_DEVICE,
    MAPPING_BAD_DEVICE_ID,
    MAPPING_BAD_TIMESTAMP,
    MAPPING_EMPTY,
    MAPPING_INVALID,
    MAPPING_UNKNOWN_PRESENCE,
)

# A mapped reading whose radio frame (`frame_paths`) is its device's last one, read less than
# this long before (the database's clock), is that frame again: a LoRaWAN retransmission comes
# seconds after the frame (NbTrans), a confirmed uplink's retry minutes at most (duty cycle).
RETRANSMISSION_WINDOW_S: Final = 600
# A time read from a payload before this (2001-01-01T00:00:00Z) is from a clock never set: a
# device counting from 1970 (Tasmota without NTP), or from an RTC's reset value (2000-01-01).
CLOCK_SET_MS: Final = 978_307_200_000
TIMESTAMP_FORMATS: Final = (
    "iso8601",
    "epoch_s",
    "epoch_ms",
    "epoch_us",
    "epoch_ns",
    "tasmota",
    "receive",
)
# Units of an epoch finer than the millisecond stored: cut to it, as an ISO time's are.
_PER_MS: Final = {"epoch_us": 1000, "epoch_ns": 1_000_000}
DEVICE_ID_POLICIES: Final = ("refuse", "normalise")
# Nested objects are flattened this deep at most; deeper leaves are left out.
MAX_FLATTEN_DEPTH: Final = 8
# Flattened leaves' names held per mapping (~0.2 KB each), and topics held per `Mappings` with
# what they match (the mapping, its wildcards, the device id a topic alone names; ~0.4 KB
# each). Full, either is emptied and fills again: a burst of one-off keys or topics (ids as
# keys, a client publishing everywhere) never keeps a fleet's own out for good, and a fleet
# larger than the bound is no slower than without it.
FLAT_NAMES_HELD: Final = 4096
TOPICS_HELD: Final = 8192
# A topic longer than this is matched at each message, never held: ids are 64 characters at
# most, so a fleet's topics stay well under it, while MQTT allows 65,535 bytes; a client
# putting long, ever new names on a mapping's topic (or on any topic the node reads) had
# them all held, 4 KB topics ~68 MB. Under it a topic held costs ~1.2 KB at most (a refused
# id quoted by its refusal; tracemalloc), ~10 MB for TOPICS_HELD.
TOPIC_HELD_CHARS: Final = 200
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
_CAPTURE_RE: Final = re.compile(r"^\{([A-Za-z_][A-Za-z0-9_]{0,31})\}\Z")
_PLACEHOLDER_RE: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z0-9_:-]+))?\}")
_PATH_STEP_RE: Final = re.compile(r"\.([^.\[\]\"]+)|\[(\d+|\*)\]|\[\"([^\"]+)\"\]")
# The step `[*]` (every item of an array) of a metric's or the time's path: an index no path
# names.
EACH: Final = -1
_NOT_IN_ID: Final = re.compile(r"[^A-Za-z0-9_.:-]")
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_NAIVE: Final = datetime(1970, 1, 1)  # a UTC wall time, as read
# Zones that are UTC at every instant: a naive time in them is read as UTC wall time.
_UTC_KEYS: Final = frozenset(
    {"UTC", "Etc/UTC", "Etc/UCT", "UCT", "Etc/Universal", "Universal", "Etc/Zulu", "Zulu"}
)
_MAX_EPOCH_MS: Final = 253_370_764_799_999
_FORBIDDEN_IN_LEVEL: Final = frozenset("/+#\x00")
# A decimal number written as a string (no NaN, infinity, hex or `_`, which float() takes).
_NUMBER_RE: Final = re.compile(r"\s*[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?\s*")
_INTEGER_RE: Final = re.compile(r"[+-]?\d+")


# --- JSON paths -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JsonPath:
    """``$``, ``$.a.b``, ``$.a[0].b``, ``$["key.with.dots"]`` (a leading ``$.`` may be left
    out). Steps are object keys (str) or array indexes (int)."""

    text: str
    steps: tuple[str | int, ...]

    def read(self, value: Any) -> Any:
        """The value at the path, or `_ABSENT`; with `[*]` steps (`EACH`), the list of the
        values found at the rest of the path in every item (`_ABSENT` for none)."""
        if EACH in self.steps:
            found = _each(value, self.steps)
            return found or _ABSENT
        for step in self.steps:
            if isinstance(step, int):
                if not isinstance(value, list) or step >= len(value):
                    return _ABSENT
            elif not isinstance(value, dict) or step not in value:
                return _ABSENT
            value = value[step]
        return value


def _each(value: Any, steps: Sequence[str | int]) -> list[Any]:
    """The values at ``steps`` from ``value``, every item of an array at a `[*]` step."""
    for number, step in enumerate(steps):
        if step == EACH:
            if not isinstance(value, list):
                return []
            rest = steps[number + 1 :]
            return [found for item in value for found in _each(item, rest)]
        if isinstance(step, int):
            if not isinstance(value, list) or step >= len(value):
                return []
        elif not isinstance(value, dict) or step not in value:
            return []
        value = value[step]
    return [value]


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Final = _Absent()


def parse_path(text: str, *, each: bool = False) -> JsonPath:
    """Raises `ValueError` (its message says why) for a path it cannot read. ``each``: the
    step `[*]` (every item of an array) is allowed (a metric's path, the time's)."""
    rest = text
    if rest == "$":
        return JsonPath(text, ())
    if rest.startswith("$"):
        rest = rest[1:]
    elif not rest.startswith(("[", ".")):
        rest = "." + rest
    steps: list[str | int] = []
    position = 0
    while position < len(rest):
        match = _PATH_STEP_RE.match(rest, position)
        if match is None:
            raise ValueError(
                f"cannot read the path {text!r} at {rest[position:]!r}: write `$.key`, "
                '`$.key[0]` or `$["key.with.dots"]`'
            )
        key, index, quoted = match.groups()
        if index == "*":
            if not each:
                raise ValueError(
                    f"cannot read the path {text!r}: `[*]` is for a metric's or the time's path"
                )
            steps.append(EACH)
        else:
            steps.append(int(index) if index is not None else (key or quoted))
        position = match.end()
    return JsonPath(text, tuple(steps))


# --- topic patterns -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TopicPattern:
    """A topic with named wildcards, each a whole level: ``tele/{device}/SENSOR``."""

    text: str
    levels: tuple[str | None, ...]  # a literal level, or None for a capture
    names: tuple[str, ...]  # the capture names, in level order
    filter: str  # the MQTT filter: every capture a `+`

    def match(self, topic: str) -> dict[str, str] | None:
        parts = topic.split("/")
        if len(parts) != len(self.levels):
            return None
        captures: dict[str, str] = {}
        names = iter(self.names)
        for part, level in zip(parts, self.levels, strict=True):
            if level is None:
                if not part:
                    return None
                captures[next(names)] = part
            elif part != level:
                return None
        return captures

    def covers(self, other: TopicPattern) -> bool:
        """Every topic ``other`` matches, this pattern matches too."""
        if len(self.levels) != len(other.levels):
            return False
        return all(a is None or a == b for a, b in zip(self.levels, other.levels, strict=True))

    def overlaps(self, other: TopicPattern) -> bool:
        """Some topic both patterns match."""
        if len(self.levels) != len(other.levels):
            return False
        return all(
            a is None or b is None or a == b for a, b in zip(self.levels, other.levels, strict=True)
        )


def parse_topic(text: str) -> TopicPattern:
    if not text:
        raise ValueError("must not be empty")
    if text.startswith(("$", "/")) or text.endswith("/"):
        raise ValueError("must not start with `$` or `/`, nor end with `/`")
    levels: list[str | None] = []
    names: list[str] = []
    for level in text.split("/"):
        capture = _CAPTURE_RE.match(level)
        if capture is not None:
            name = capture.group(1)
            if name in names:
                raise ValueError(f"names the wildcard {{{name}}} twice")
            names.append(name)
            levels.append(None)
            continue
        if not level:
            raise ValueError("must not contain an empty level")
        if "{" in level or "}" in level:
            raise ValueError(
                f"level {level!r}: a named wildcard is a whole level, `{{name}}` (a letter or "
                "`_`, then letters, digits, `_`)"
            )
        if not _FORBIDDEN_IN_LEVEL.isdisjoint(level):
            raise ValueError(
                f"level {level!r}: use a named wildcard `{{name}}` instead of `+`/`#` (and no NUL)"
            )
        levels.append(level)
    mqtt_filter = "/".join("+" if level is None else level for level in levels)
    return TopicPattern(text, tuple(levels), tuple(names), mqtt_filter)


# --- templates ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Template:
    """Text with ``{name}`` and ``{params.key}`` placeholders; any other brace is literal, so
    a JSON template keeps its own braces (``{"id":{command_id}}``).

    A value goes in as itself (a string) or as JSON (anything else). In a template that is a
    JSON document (placeholders aside), a value keeps the document's shape: a string put
    inside one of its JSON strings is escaped there, and one put where it has a JSON value is
    written as a JSON string unless it is a JSON number, ``true``, ``false`` or ``null``
    written as text (which goes as itself). A quote in a display text, or one written to add
    a field (``"reboot": true``), used to change the payload the device got."""

    text: str
    pieces: tuple[tuple[str, str | None, str | None], ...]  # literal, name, key
    # Per piece: where its value goes in a JSON template ("string": inside a JSON string,
    # "value": where a JSON value stands); None for a template that is no JSON document.
    slots: tuple[str | None, ...] = ()

    def names(self) -> set[str]:
        return {name for _, name, _ in self.pieces if name is not None}

    def render(self, values: Mapping[str, Any]) -> str:
        """Raises `KeyError` (the placeholder) for a value it lacks."""
        out: list[str] = []
        for index, (literal, name, key) in enumerate(self.pieces):
            out.append(literal)
            if name is None:
                continue
            value = values[name]
            if key is not None:
                if not isinstance(value, dict) or key not in value:
                    raise KeyError(f"{name}.{key}")
                value = value[key]
            slot = self.slots[index] if self.slots else None
            out.append(_slotted(value, slot))
        return "".join(out)


def _slotted(value: object, slot: str | None) -> str:
    """``value`` as it goes in at a slot of a template (`Template`)."""
    if slot == "string":
        text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
        return msgspec.json.encode(text).decode()[1:-1]
    if isinstance(value, str):
        if slot == "value" and not _JSON_LITERAL_RE.fullmatch(value):
            return msgspec.json.encode(value).decode()
        return value
    return msgspec.json.encode(value).decode()


# A JSON number, true, false or null: what a string may stand for where a JSON value goes.
_JSON_LITERAL_RE: Final = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


def parse_template(text: str) -> Template:
    pieces: list[tuple[str, str | None, str | None]] = []
    position = 0
    for match in _PLACEHOLDER_RE.finditer(text):
        pieces.append((text[position : match.start()], match.group(1), match.group(2)))
        position = match.end()
    pieces.append((text[position:], None, None))
    return Template(text, tuple(pieces), _json_slots(pieces))


def _json_slots(pieces: Sequence[tuple[str, str | None, str | None]]) -> tuple[str | None, ...]:
    """Where each placeholder stands if the template is a JSON object or array
    (`Template.slots`), else nothing. Found by walking its literal text as a JSON lexer
    would (in a string or not, escapes), then checked: with a neutral value at each slot,
    the text must parse."""
    slots: list[str | None] = []
    probe: list[str] = []
    in_string = escaped = False
    for literal, name, _ in pieces:
        for char in literal:
            if escaped:
                escaped = False
            elif in_string and char == "\\":
                escaped = True
            elif char == '"':
                in_string = not in_string
        probe.append(literal)
        if name is None:
            slots.append(None)
            continue
        slots.append("string" if in_string else "value")
        probe.append("x" if in_string else "0")
    text = "".join(probe).strip()
    if not any(slot is not None for slot in slots) or text[:1] not in ("{", "["):
        return ()  # no placeholder, or no JSON object or array (`{params.value}` is text)
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError:
        return ()  # no JSON document: values go in as they are
    return tuple(slots)


# --- what a message becomes -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MappedTelemetry:
    mapping: str
    device_id: str
    message: Telemetry
    event_id: str
    captures: dict[str, str]
    # The frame's identity (SHA-256 hex of the values at frame_paths; None: the mapping has
    # none, or the payload none of them): the same frame again soon after is a retransmission.
    frame: str | None = None


@dataclass(frozen=True, slots=True)
class MappedPresence:
    mapping: str
    device_id: str
    value: str  # "online" | "offline"
    captures: dict[str, str]
    # Whether ``captures`` hold every wildcard the mapping's commands name, so may be what the
    # device's commands are rendered from (device_mapping): a presence topic with fewer
    # wildcards than the telemetry topic leaves the record of the device's readings alone.
    records: bool = True


@dataclass(frozen=True, slots=True)
class Refusal:
    mapping: str
    code: str
    detail: str


Mapped = MappedTelemetry | MappedPresence | Refusal


@dataclass(frozen=True, slots=True)
class Downlink:
    topic: str
    payload: bytes


class DownlinkError(ValueError):
    """A command a mapping cannot render (a placeholder without its value, a topic level it
    cannot hold): ``code`` is the command's ``raw_result_code``."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(frozen=True, slots=True)
class _MetricMap:
    path: JsonPath
    name: str
    scale: float
    offset: float


@dataclass(frozen=True, slots=True)
class _EventMap:
    path: JsonPath
    type: str
    type_path: JsonPath | None


@dataclass(frozen=True, slots=True)
class CompiledMapping:
    """One compiled mapping (its keys resolved against its profile)."""

    name: str
    topic: TopicPattern | None
    device: Template | None
    device_path: JsonPath | None
    normalise_ids: bool
    # Tried in order: the first that holds a value dates the reading (none: the receipt).
    timestamp_paths: tuple[JsonPath, ...]
    timestamp_format: str
    timezone: ZoneInfo | None
    receive_window_ms: int
    flatten: JsonPath | None
    exclude: frozenset[str]
    metrics: tuple[_MetricMap, ...]
    events: tuple[_EventMap, ...]
    presence_topic: TopicPattern | None
    presence_device: Template | None
    presence_path: JsonPath | None
    online: str
    offline: str
    command_topic: Template | None
    command_payload: Template | None
    portable_ids: bool = False
    frame_paths: tuple[JsonPath, ...] = ()
    # The presence topic holds every wildcard command_topic and command_payload name.
    presence_records: bool = True
    _flattened_away: frozenset[str] = field(default=frozenset())
    # The metric name of each flattened leaf's path met (see _leaves), FLAT_NAMES_HELD at
    # most: a name is a join and a regular expression over the path, and a fleet's documents
    # repeat their keys.
    _flat_names: dict[tuple[tuple[str, ...], str], str | None] = field(
        default_factory=dict, compare=False, repr=False
    )


# --- compiling ------------------------------------------------------------------------------


def compile_mappings(
    configs: Sequence[MappingConfig],
    *,
    native_filters: Sequence[str] = (),
    portable_ids: bool = False,
    prefix: str = "ingest.mappings",
) -> Mappings:
    """Every mapping compiled; every mistake reported at once (`ConfigError`s named by their
    key path, ``ingest.mappings[1].topic``). ``native_filters``: the gateway's own topic
    filters, which no mapping may match."""
    errors: list[ConfigError] = []
    compiled: list[CompiledMapping] = []
    names: dict[str, int] = {}
    for index, config in enumerate(configs):
        path = f"{prefix}[{index}]"
        before = len(errors)
        mapping = _compile_one(config, path, errors, portable_ids)
        if config.name in names:
            errors.append(
                ConfigError(
                    f"{path}.name",
                    f"{config.name!r} is taken already by {prefix}[{names[config.name]}]",
                )
            )
        elif config.name:
            names[config.name] = index
        if mapping is not None and len(errors) == before:
            compiled.append(mapping)
    if not errors:
        errors.extend(_overlaps(compiled, native_filters, prefix))
    if errors:
        raise config_errors(errors)
    return Mappings(tuple(compiled))


def _overlaps(
    compiled: Sequence[CompiledMapping], native_filters: Sequence[str], prefix: str
) -> list[ConfigError]:
    errors: list[ConfigError] = []
    natives = [_native_pattern(text) for text in native_filters]
    for index, mapping in enumerate(compiled):
        for key, pattern in (("topic", mapping.topic), ("presence_topic", mapping.presence_topic)):
            if pattern is None:
                continue
            for native in natives:
                if pattern.overlaps(native):
                    errors.append(
                        ConfigError(
                            f"{prefix}[{index}].{key}",
                            f"{pattern.text!r} would match the gateway's own topics "
                            f"({native.filter!r}): choose a topic outside [mqtt] topic_prefix",
                        )
                    )
            # The commands the gateway sends to mapped devices are its own topics too: a
            # pattern matching every topic of a command_topic would read each command back as
            # a reading of a device named by the command's levels. (One that matches some of
            # them only, for a device of a given name, is as two mappings' topics that
            # overlap: tried in file order.)
            for number, other in enumerate(compiled):
                command = _command_pattern(other)
                if command is not None and pattern.covers(command):
                    errors.append(
                        ConfigError(
                            f"{prefix}[{index}].{key}",
                            f"{pattern.text!r} would match every command the gateway sends "
                            f"to the devices of {prefix}[{number}] ({command.text!r}): "
                            "choose topics apart",
                        )
                    )
    return errors


def _command_pattern(mapping: CompiledMapping) -> TopicPattern | None:
    """The topics ``mapping`` sends commands to: a level with a placeholder is any level."""
    if mapping.command_topic is None:
        return None
    text = mapping.command_topic.text
    levels = tuple(None if _PLACEHOLDER_RE.search(level) else level for level in text.split("/"))
    return TopicPattern(text, levels, (), text)


def _native_pattern(mqtt_filter: str) -> TopicPattern:
    levels = tuple(None if level in ("+", "#") else level for level in mqtt_filter.split("/"))
    return TopicPattern(mqtt_filter, levels, (), mqtt_filter)


class _Compiler:
    """One mapping's keys compiled, each mistake appended to ``errors`` with its key path."""

    def __init__(self, config: MappingConfig, path: str, errors: list[ConfigError]) -> None:
        self.config = config
        self.path = path
        self.errors = errors

    def error(self, key: str, message: str) -> None:
        self.errors.append(ConfigError(f"{self.path}.{key}", message))

    def json_path(self, key: str, text: str | None, *, each: bool = False) -> JsonPath | None:
        if not text:
            return None
        try:
            return parse_path(text, each=each)
        except ValueError as exc:
            self.error(key, str(exc))
            return None

    def topic(self, key: str, text: str | None) -> TopicPattern | None:
        if not text:
            return None
        try:
            return parse_topic(text)
        except ValueError as exc:
            self.error(key, f"{text!r} {exc}")
            return None

    def device(self, topic: TopicPattern | None, device_path: JsonPath | None) -> Template | None:
        text = self.config.device
        if text and device_path is not None:
            self.error("device_path", "give device or device_path, not both")
            return None
        if text:
            device = parse_template(text)
            if any(key is not None for _, _, key in device.pieces):
                self.error("device", "only topic wildcards may name the device (`{device}`)")
            unknown = device.names() - set(topic.names if topic else ())
            if unknown:
                self.error(
                    "device",
                    f"names {_braced(unknown)}, not a wildcard of topic {self.config.topic!r}",
                )
            return device
        if device_path is None and topic is not None:
            if len(topic.names) == 1:
                return parse_template("{" + topic.names[0] + "}")
            if not topic.names:
                self.error(
                    "device_path",
                    "required: the topic has no wildcard to name the device by",
                )
            else:
                self.error("device", f"required: which of {_braced(topic.names)} names the device")
        return None

    def presence_device(
        self, presence_topic: TopicPattern | None, device: Template | None
    ) -> Template | None:
        """The presence topic names its device from its own wildcards, by the same template."""
        if presence_topic is None:
            return None
        if device is not None and device.names() <= set(presence_topic.names):
            return device
        # Its own wildcard, bare: the device as the telemetry names it only when that is a
        # wildcard bare too (or the payload names it). A template around it ("plant1-{id}")
        # would name another device: its presence stored for a device of its own.
        bare = device is None or (
            len(device.pieces) == 2 and device.pieces[0][0] == "" and device.pieces[1][0] == ""
        )
        if len(presence_topic.names) == 1 and bare:
            return parse_template("{" + presence_topic.names[0] + "}")
        self.error(
            "presence_topic",
            "must hold the wildcards the device is named by "
            f"({_braced(device.names() if device else ())})",
        )
        return None

    def timestamp(self) -> tuple[tuple[JsonPath, ...], str]:
        config = self.config
        fmt = config.timestamp_format or ("iso8601" if config.timestamp_path else "receive")
        if fmt not in TIMESTAMP_FORMATS:
            self.error("timestamp_format", f"one of {', '.join(TIMESTAMP_FORMATS)}")
        given = config.timestamp_path
        texts = (
            [("timestamp_path", given)]
            if isinstance(given, str)
            else [(f"timestamp_path[{number}]", text) for number, text in enumerate(given or ())]
        )
        paths = tuple(
            parsed
            for key, text in texts
            if (parsed := self.json_path(key, text, each=True)) is not None
        )
        if fmt != "receive" and not paths:
            self.error("timestamp_path", f"required with timestamp_format = {fmt!r}")
        if fmt == "receive" and paths:
            self.error("timestamp_format", "must not be 'receive' when timestamp_path is given")
        return paths, fmt

    def zone(self) -> ZoneInfo | None:
        name = self.config.timezone
        if not name:
            return None
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            self.error("timezone", f"unknown time zone {name!r} (an IANA name: Europe/Berlin)")
            return None

    def metrics(self) -> list[_MetricMap]:
        metrics = []
        for number, metric in enumerate(self.config.metrics or ()):
            key = f"metrics[{number}]"
            parsed = self.json_path(f"{key}.path", metric.path, each=True)
            if metric.name and DEVICE_ID_RE.fullmatch(metric.name) is None:
                self.error(f"{key}.name", f"must match {DEVICE_ID_RE.pattern}")
            if not (math.isfinite(metric.scale) and math.isfinite(metric.offset)):
                self.error(key, "scale and offset must be finite")
            if parsed is None:
                continue
            if not parsed.steps:
                self.error(f"{key}.path", "must name a value inside the payload, not `$`")
                continue
            name = metric.name or _flat_name(parsed.steps)
            if name is None:
                self.error(f"{key}.name", "required: the path is too long to name the metric")
                continue
            metrics.append(_MetricMap(parsed, name, metric.scale, metric.offset))
        return metrics

    def events(self) -> list[_EventMap]:
        events = []
        for number, config in enumerate(self.config.events or ()):
            key = f"events[{number}]"
            parsed = self.json_path(f"{key}.path", config.path)
            type_path = self.json_path(f"{key}.type_path", config.type_path)
            if config.type and DEVICE_ID_RE.fullmatch(config.type) is None:
                self.error(f"{key}.type", f"must match {DEVICE_ID_RE.pattern}")
            if config.type and type_path is not None:
                self.error(f"{key}.type_path", "give type or type_path, not both")
            if parsed is not None:
                events.append(_EventMap(parsed, config.type, type_path))
        return events

    def commands(
        self, topic: TopicPattern | None, device_path: JsonPath | None
    ) -> tuple[Template | None, Template | None]:
        config = self.config
        if not config.command_topic:
            return None, None
        command_topic = parse_template(config.command_topic)
        command_payload = parse_template(config.command_payload or "")
        captures = set(topic.names if topic else ())
        if device_path is not None:
            self.error(
                "command_topic",
                "needs the device named by topic wildcards (device), not by device_path",
            )
        allowed = captures | {"command", "device_id"}
        unknown = command_topic.names() - allowed
        if unknown or any(key is not None for _, _, key in command_topic.pieces):
            self.error("command_topic", f"may name {_braced(allowed)} only")
        allowed = captures | {"command", "command_id", "device_id", "params"}
        unknown = command_payload.names() - allowed
        if unknown:
            self.error(
                "command_payload",
                f"names {_braced(unknown)}; it may name {_braced(allowed)} and {{params.<key>}}",
            )
        return command_topic, command_payload


def _compile_one(
    raw: MappingConfig, path: str, errors: list[ConfigError], portable_ids: bool
) -> CompiledMapping | None:
    if not raw.name:
        errors.append(
            ConfigError(f"{path}.name", "required: dead letters and metrics name the mapping by it")
        )
    elif _NAME_RE.match(raw.name) is None:
        errors.append(ConfigError(f"{path}.name", "1 to 64 letters, digits, `_` and `-`"))
    if raw.profile and raw.profile not in PROFILES:
        errors.append(
            ConfigError(
                f"{path}.profile", f"unknown profile {raw.profile!r}; known: {', '.join(PROFILES)}"
            )
        )
        return None
    config = resolve(raw)
    c = _Compiler(config, path, errors)
    topic = c.topic("topic", config.topic)
    if not config.topic and not config.presence_topic:
        c.error("topic", "required (or presence_topic): the topic its devices publish on")
    presence_topic = c.topic("presence_topic", config.presence_topic)
    device_path = c.json_path("device_path", config.device_path)
    device = c.device(topic, device_path)
    presence_device = c.presence_device(presence_topic, device)
    if config.device_ids not in DEVICE_ID_POLICIES:
        c.error("device_ids", f"one of {', '.join(DEVICE_ID_POLICIES)}")
    timestamp_paths, timestamp_format = c.timestamp()
    zone = c.zone()
    window = config.receive_window_ms or 0
    if not 1 <= window <= 3_600_000:
        c.error("receive_window_ms", "from 1 to 3600000")
    metrics, events = c.metrics(), c.events()
    flatten = c.json_path("flatten", config.flatten)
    if flatten is None and not metrics and not events and topic is not None:
        c.error("metrics", "the mapping reads nothing: give flatten, metrics or events")
    command_topic, command_payload = c.commands(topic, device_path)
    flattened_away = frozenset(
        name
        for m in metrics
        if flatten is not None
        and m.path.steps[: len(flatten.steps)] == flatten.steps
        and (name := _flat_name(m.path.steps[len(flatten.steps) :])) is not None
    )
    # The wildcards of the telemetry topic a command is rendered with: a presence message
    # records its own only when it has them all.
    commanded = (
        set()
        if command_topic is None or command_payload is None or topic is None
        else (command_topic.names() | command_payload.names()) & set(topic.names)
    )
    return CompiledMapping(
        name=raw.name,
        topic=topic,
        device=device,
        device_path=device_path,
        normalise_ids=config.device_ids == "normalise",
        timestamp_paths=timestamp_paths,
        timestamp_format=timestamp_format,
        timezone=zone,
        receive_window_ms=window,
        flatten=flatten,
        exclude=frozenset(config.exclude or ()),
        metrics=tuple(metrics),
        events=tuple(events),
        presence_topic=presence_topic,
        presence_device=presence_device,
        presence_path=c.json_path("presence_path", config.presence_path),
        online=config.online or "",
        offline=config.offline or "",
        command_topic=command_topic,
        command_payload=command_payload,
        portable_ids=portable_ids,
        presence_records=presence_topic is None or commanded <= set(presence_topic.names),
        frame_paths=tuple(
            parsed
            for number, text in enumerate(config.frame_paths or ())
            if (parsed := c.json_path(f"frame_paths[{number}]", text)) is not None
        ),
        _flattened_away=flattened_away,
    )


def _braced(names: Iterator[str] | Sequence[str] | set[str] | frozenset[str]) -> str:
    return ", ".join("{" + name + "}" for name in sorted(names)) or "nothing"


def _flat_name(steps: Sequence[str | int]) -> str | None:
    """The metric name of a leaf: its keys joined with ``.``, every character the id grammar
    refuses as ``_``; None past 64 characters (left out)."""
    name = _NOT_IN_ID.sub("_", ".".join(str(step) for step in steps if step != EACH))
    return name if 0 < len(name) <= 64 else None


# --- reading messages -----------------------------------------------------------------------


class Mappings:
    """The compiled ``[[ingest.mappings]]``, tried in file order: the first whose topic (or
    presence topic) matches reads the message."""

    def __init__(self, mappings: tuple[CompiledMapping, ...] = ()) -> None:
        self.mappings = mappings
        self.by_name = {mapping.name: mapping for mapping in mappings}
        # What each topic met matched (TOPICS_HELD at most): see _matched.
        self._topics: dict[str, _Match | None] = {}

    def __bool__(self) -> bool:
        return bool(self.mappings)

    def filters(self) -> tuple[list[str], list[str]]:
        """The MQTT filters to subscribe to: (telemetry, presence). Presence is retained, and
        retained messages never reach a shared subscription: those are subscribed directly."""
        telemetry: list[str] = []
        presence: list[str] = []
        for mapping in self.mappings:
            if mapping.topic is not None and mapping.topic.filter not in telemetry:
                telemetry.append(mapping.topic.filter)
            if mapping.presence_topic is not None and mapping.presence_topic.filter not in presence:
                presence.append(mapping.presence_topic.filter)
        return telemetry, presence

    def matches(self, topic: str) -> bool:
        return self._matched(topic) is not None

    def presence(self, topic: str) -> bool | None:
        """Whether the mapping that reads ``topic`` reads it as presence (False: as
        readings); None when no mapping matches."""
        found = self._matched(topic)
        return None if found is None else found.presence

    def _matched(self, topic: str) -> _Match | None:
        """``_match`` with the device id the topic alone names, held per topic: a fleet's
        devices publish on the same topics again and again (a match and the id's checks cost
        1.0-1.4 µs a message, a look-up 0.1)."""
        topics = self._topics
        try:
            return topics[topic]
        except KeyError:
            pass
        found = self._match(topic)
        matched = None
        if found is not None:
            mapping, captures, presence = found
            template = mapping.presence_device if presence else mapping.device
            device = None if template is None else _device_id(mapping, template, captures, None)
            matched = _Match(mapping, captures, presence, device)
        if len(topic) > TOPIC_HELD_CHARS:
            return matched
        if len(topics) >= TOPICS_HELD:
            topics.clear()
        topics[topic] = matched
        return matched

    def _match(self, topic: str) -> tuple[CompiledMapping, dict[str, str], bool] | None:
        """The first mapping whose topic (or presence topic) matches ``topic``: ``(mapping,
        captures, presence)``; None when none does. ``read`` and ``order_key`` both go by it."""
        for mapping in self.mappings:
            if mapping.topic is not None:
                captures = mapping.topic.match(topic)
                if captures is not None:
                    return mapping, captures, False
            if mapping.presence_topic is not None:
                captures = mapping.presence_topic.match(topic)
                if captures is not None:
                    return mapping, captures, True
        return None

    def read(self, topic: str, payload: bytes, received_ms: int) -> Mapped | None:
        """What the first mapping matching ``topic`` makes of the message; None when no
        mapping matches (a native topic, or none of ours)."""
        found = self._matched(topic)
        if found is None:
            return None
        # A copy: what is read keeps its wildcards (the mapping memory, commands).
        captures = dict(found.captures)
        if found.presence:
            return _presence(found.mapping, captures, payload, found.device)
        return _telemetry(found.mapping, captures, payload, received_ms, found.device)

    def order_key(self, topic: str) -> tuple[bool, str | None]:
        """``(matched, device)``: whether a mapping reads ``topic`` (the one ``read`` would
        take), and the device id it names the message by when the topic alone names it (as
        ``read`` names it; ``""`` for an id it refuses). None: the id is in the payload."""
        found = self._matched(topic)
        if found is None:
            return False, None
        device = found.device
        if device is None:
            return True, None
        return True, "" if isinstance(device, Refusal) else device

    def downlink(
        self,
        mapping_name: str,
        captures: Mapping[str, str],
        *,
        device_id: str,
        command: str,
        command_id: int,
        params: Mapping[str, Any],
    ) -> Downlink | None:
        """The command's topic and payload for a device seen through ``mapping_name``; None
        when that mapping is gone from the configuration. Raises `DownlinkError`."""
        mapping = self.by_name.get(mapping_name)
        if mapping is None:
            return None
        if mapping.command_topic is None or mapping.command_payload is None:
            raise DownlinkError(
                "MAPPING_NO_COMMANDS",
                f"not sent: mapping {mapping_name!r} has no command_topic",
            )
        values: dict[str, Any] = {
            **captures,
            "command": command,
            "command_id": command_id,
            "device_id": device_id,
            "params": dict(params),
        }
        try:
            topic = mapping.command_topic.render(values)
            payload = mapping.command_payload.render(values)
        except KeyError as exc:
            raise DownlinkError(
                "MAPPING_TEMPLATE",
                f"not sent: mapping {mapping_name!r} has no value for {{{exc.args[0]}}}",
            ) from None
        if not topic or "+" in topic or "#" in topic or "\x00" in topic or "//" in topic:
            raise DownlinkError(
                "MAPPING_TEMPLATE", f"not sent: {topic!r} is not a topic a command can go to"
            )
        if topic.count("/") != mapping.command_topic.text.count("/"):
            # A value with a `/` (a command's name is free text) is more than the one level
            # it was put in: the topic would be one the mapping does not describe.
            raise DownlinkError(
                "MAPPING_TEMPLATE",
                f"not sent: {topic!r} has more levels than {mapping.command_topic.text!r}"
                " (a value put in a level holds a `/`)",
            )
        return Downlink(topic, payload.encode())


@dataclass(frozen=True, slots=True)
class _Match:
    """A topic matched: by which mapping, its wildcards (never changed: ``read`` hands out
    copies), whether as the presence topic, and the device id the topic alone names (a
    refusal for one outside the grammar; None when the payload names it)."""

    mapping: CompiledMapping
    captures: dict[str, str]
    presence: bool
    device: str | Refusal | None


def _refuse(mapping: CompiledMapping, code: str, detail: str) -> Refusal:
    return Refusal(mapping.name, code, f"mapping {mapping.name!r}: {detail}")


def _device_id(
    mapping: CompiledMapping, template: Template | None, captures: dict[str, str], document: Any
) -> str | Refusal:
    if template is not None:
        raw = template.render(captures)
    else:
        assert mapping.device_path is not None
        value = mapping.device_path.read(document)
        if isinstance(value, bool) or not isinstance(value, str | int):
            return _refuse(
                mapping,
                MAPPING_NO_DEVICE,
                f"no device id (a string or an integer) at {mapping.device_path.text}",
            )
        raw = str(value)
    device_id = raw
    if mapping.normalise_ids:
        device_id = _NOT_IN_ID.sub("_", raw)
        if mapping.portable_ids:
            device_id = device_id.replace(NOT_PORTABLE, "_")
    valid = DEVICE_ID_RE.fullmatch(device_id) is not None and not (
        mapping.portable_ids and NOT_PORTABLE in device_id
    )
    if not valid:
        return _refuse(
            mapping,
            MAPPING_BAD_DEVICE_ID,
            f"device id {raw!r} must match {DEVICE_ID_RE.pattern}"
            + (" without `.` ([mqtt] broker_family)" if mapping.portable_ids else "")
            + ("" if mapping.normalise_ids else " (device_ids = 'normalise' maps it)"),
        )
    return device_id


def _json_object(mapping: CompiledMapping, payload: bytes) -> dict[str, Any] | Refusal:
    try:
        document = msgspec.json.decode(payload)
    except msgspec.DecodeError as exc:
        return _refuse(mapping, MAPPING_MALFORMED, f"not JSON: {exc}")
    except RecursionError as exc:
        # msgspec raises this, not a DecodeError, for JSON nested a few thousand deep (~10 kB).
        return _refuse(mapping, MAPPING_MALFORMED, f"nesting too deep to decode: {exc}")
    if not isinstance(document, dict):
        return _refuse(
            mapping, MAPPING_MALFORMED, f"a JSON {type(document).__name__}, not an object"
        )
    return document


def _telemetry(  # noqa: PLR0911 - one return per reason a payload is refused
    mapping: CompiledMapping,
    captures: dict[str, str],
    payload: bytes,
    received_ms: int,
    device: str | Refusal | None,
) -> Mapped:
    """``device``: the id the topic names (None: the payload names it, at device_path)."""
    document = _json_object(mapping, payload)
    if isinstance(document, Refusal):
        return document
    device_id = device if device is not None else _device_id(mapping, None, captures, document)
    if isinstance(device_id, Refusal):
        return device_id
    ts_ms = _timestamp(mapping, document, received_ms)
    if isinstance(ts_ms, Refusal):
        return ts_ms
    metrics = _metrics(mapping, document)
    events = _events(mapping, document)
    if isinstance(events, Refusal):
        return events
    if not metrics and not events:
        return _refuse(mapping, MAPPING_EMPTY, "no metric and no event in the payload")
    wire: dict[str, Any] = {"ts": ts_ms}
    if metrics:
        wire["metrics"] = metrics
    if events:
        wire["events"] = events
    try:
        message = msgspec.convert(wire, Telemetry)
    except msgspec.ValidationError as exc:
        return _refuse(mapping, MAPPING_INVALID, str(exc))
    # As a native message's: the device and the decoded message, its time included (the
    # table's key is the id and the time). The time read from the payload makes every
    # redelivery the same row; a receive time is cut to the window for the same reason.
    event_id = telemetry_event_id(device_id, message)
    if mapping.timestamp_paths and ts_ms < CLOCK_SET_MS:
        # A clock never set (a device that never reached its time server counts from 1970
        # at each start): its time repeats at every start, so the reading's receive time, cut
        # to the window, tells one start's reading from the same one of the start before.
        window = mapping.receive_window_ms
        event_id = hashlib.sha256(
            f"{event_id}:{received_ms // window * window}".encode()
        ).hexdigest()
    return MappedTelemetry(
        mapping.name, device_id, message, event_id, captures, _frame(mapping, document)
    )


def _frame(mapping: CompiledMapping, document: dict[str, Any]) -> str | None:
    """The identity of the radio frame the reading came in (`MappedTelemetry.frame`)."""
    if not mapping.frame_paths:
        return None
    values = [path.read(document) for path in mapping.frame_paths]
    if all(value is _ABSENT for value in values):
        return None
    found = [None if value is _ABSENT else value for value in values]
    return hashlib.sha256(msgspec.json.encode([mapping.name, found], order="sorted")).hexdigest()


def _timestamp(
    mapping: CompiledMapping, document: dict[str, Any], received_ms: int
) -> int | Refusal:
    if not mapping.timestamp_paths:
        window = mapping.receive_window_ms
        return received_ms // window * window
    # The first path that holds a value (the last one's absence is the refusal's).
    for path in mapping.timestamp_paths:
        value = path.read(document)
        if value is not _ABSENT:
            break
    fmt = mapping.timestamp_format
    if value is _ABSENT and fmt == "tasmota":
        # Tasmota leaves `Time` out of its Zigbee and LoRaWAN bridges' reports (`ZbReceived`,
        # `LwReceived`) unless SetOption144 is on: dated as a payload without a time is.
        window = mapping.receive_window_ms
        return received_ms // window * window
    where = f"{path.text} ({fmt})"
    try:
        if isinstance(value, list) and EACH in path.steps:
            # `[*]`: the middle one of the times found (the earlier of the two middle ones
            # of an even count: a time one of them gave, never between them). Read on one
            # clock (ChirpStack's nsTime) any is right; read on each gateway's own, one
            # clock far off moves no reading while most agree.
            times = sorted(_epoch_ms(item, fmt, mapping.timezone, received_ms) for item in value)
            ms = times[(len(times) - 1) // 2]
        else:
            ms = _epoch_ms(value, fmt, mapping.timezone, received_ms)
    except (ValueError, OverflowError) as exc:
        shown = "absent" if value is _ABSENT else repr(value)[:80]
        return _refuse(mapping, MAPPING_BAD_TIMESTAMP, f"{shown} at {where}: {exc}")
    if not 0 <= ms <= _MAX_EPOCH_MS:
        return _refuse(mapping, MAPPING_BAD_TIMESTAMP, f"{value!r} at {where} is out of range")
    return ms


def _epoch_ms(value: Any, fmt: str, zone: ZoneInfo | None, received_ms: int) -> int:
    """Raises `ValueError` saying why ``value`` is no time of format ``fmt``. A local time
    that names two instants (the hour the clocks go back shows twice) or none (the hour they
    go forward is never shown, by a clock that changes) is read as the one of its two
    readings (the offsets before and after the change) nearer ``received_ms``, when it was
    received: a live device's second pass is its second pass, not a copy of the first's
    (dated an hour early, a reading equal to the first pass's was taken for a redelivery and
    lost). A redelivery more than half an hour late in that hour is dated in the other pass."""
    if fmt == "tasmota":
        # Tasmota's `Time`, as its `Time` command sets it: an ISO string (`Time 1`, `2`, `4`)
        # or the UTC epoch in seconds (`Time 3`), whose readings were all refused.
        fmt = "iso8601" if isinstance(value, str) else "epoch_s"
    if fmt == "iso8601":
        if not isinstance(value, str):
            raise ValueError("not a string")
        parsed = datetime.fromisoformat(value)
        if parsed.utcoffset() is None:
            if zone is None:
                raise ValueError("no UTC offset, and no timezone for the mapping")
            if zone.key in _UTC_KEYS:
                # The same instant as with the zone, without its look-ups (0.9 -> 0.3 µs).
                return (parsed - _EPOCH_NAIVE) // _MS
            parsed = parsed.replace(tzinfo=zone)
            ms = (parsed - _EPOCH) // _MS
            if _one_offset(zone, parsed.year, parsed.month, parsed.day, parsed.hour):
                return ms  # every hour of the year but two: one reading
            other = parsed.replace(fold=1)
            other_ms = (other - _EPOCH) // _MS
            return other_ms if abs(other_ms - received_ms) < abs(ms - received_ms) else ms
        return (parsed - _EPOCH) // _MS
    if isinstance(value, str) and _NUMBER_RE.fullmatch(value) is not None:
        # A number written as a string ("1767225600"): that number, as for a scaled metric.
        text = value.strip()
        value = int(text) if _INTEGER_RE.fullmatch(text) else float(text)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("not a number")  # noqa: TRY004 - reported as the payload's mistake
    per_ms = _PER_MS.get(fmt)
    if per_ms is not None:
        return value // per_ms if isinstance(value, int) else math.floor(value / per_ms)
    return round(value * 1000) if fmt == "epoch_s" else round(value)


_MS: Final = datetime(1970, 1, 1, 0, 0, 0, 1000, tzinfo=UTC) - _EPOCH


@functools.lru_cache(maxsize=256)
def _one_offset(zone: ZoneInfo, year: int, month: int, day: int, hour: int) -> bool:
    """Whether every local time of this hour in ``zone`` has one offset (no change of the
    clocks inside it, so no time of it names two instants or none). Its first instant before
    any change and its last after one compare; remembered per hour, as a fleet's samples
    come hour by hour: 0.2 µs a sample where comparing each time's two readings cost 1.1."""
    first = datetime(year, month, day, hour, tzinfo=zone)
    last = first.replace(minute=59, second=59, microsecond=999999, fold=1)
    return first.utcoffset() == last.utcoffset()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _in_int64(value: int) -> bool:
    return -(2**63) <= value < 2**63


def _metrics(mapping: CompiledMapping, document: dict[str, Any]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    if mapping.flatten is not None:
        root = mapping.flatten.read(document)
        if isinstance(root, dict):
            for name, value in _leaves(root, mapping._flat_names):
                if name not in mapping.exclude and name not in mapping._flattened_away:
                    metrics[name] = value
    for metric in mapping.metrics:
        value = metric.path.read(document)
        if isinstance(value, list) and EACH in metric.path.steps:
            # `[*]`: the greatest number found (`$.rxInfo[*].rssi`: the best gateway's).
            value = max((v for v in value if _is_number(v)), default=_ABSENT)
        if value is _ABSENT or value is None or isinstance(value, dict | list):
            continue
        scaled = metric.scale != 1.0 or metric.offset != 0.0
        if scaled and isinstance(value, str) and _NUMBER_RE.fullmatch(value) is not None:
            # A number written as a string ("21.5", as some firmwares send them) is scaled as
            # that number: stored as read, a °F figure was named as the °C metric, and as text
            # no threshold rule compares. A string that is no number stays as read.
            value = float(value)
        # An integer outside int64 is never scaled (one too large for a float raises
        # OverflowError): it stays as read, refused as MAPPING_INVALID as it is unscaled.
        if scaled and (
            isinstance(value, float)
            or (isinstance(value, int) and not isinstance(value, bool) and _in_int64(value))
        ):
            value = value * metric.scale + metric.offset
        metrics[metric.name] = value
    return metrics


def _leaves(
    root: dict[str, Any], names: dict[tuple[tuple[str, ...], str], str | None]
) -> Iterator[tuple[str, Any]]:
    """Each leaf of ``root`` telemetry can carry, with its name (``names`` holds those made)."""
    stack: list[tuple[tuple[str, ...], dict[str, Any]]] = [((), root)]
    while stack:
        keys, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                if len(keys) + 1 < MAX_FLATTEN_DEPTH:
                    stack.append(((*keys, key), value))
            elif value is not None and not isinstance(value, list) and _fits(value):
                at = (keys, key)
                name = names.get(at, _ABSENT)
                if name is _ABSENT:
                    name = _flat_name((*keys, key))
                    # A path left out (its name over 64 characters) is never held: its keys
                    # may be of any length (a document as a key), new at every message.
                    if name is not None:
                        if len(names) >= FLAT_NAMES_HELD:
                            names.clear()
                        names[at] = name
                if name is not None:
                    yield name, value  # type: ignore[misc]


def _fits(value: Any) -> bool:
    """A flattened value telemetry can carry; one it cannot (a string over 1024 characters, an
    integer outside int64) is left out, as arrays are, rather than refuse the whole reading."""
    if isinstance(value, str):
        return len(value) <= MAX_STRING_BYTES
    if isinstance(value, int) and not isinstance(value, bool):
        return INT64_MIN <= value <= INT64_MAX
    return True


def _events(mapping: CompiledMapping, document: dict[str, Any]) -> list[dict[str, Any]] | Refusal:
    events: list[dict[str, Any]] = []
    for event in mapping.events:
        value = event.path.read(document)
        if value is _ABSENT or value is None or value == "":
            continue
        for item in value if isinstance(value, list) else [value]:
            if event.type:
                kind: Any = event.type
            elif event.type_path is not None:
                kind = event.type_path.read(item)
            else:
                kind = item
            if not isinstance(kind, str) or DEVICE_ID_RE.fullmatch(kind) is None:
                return _refuse(
                    mapping,
                    MAPPING_INVALID,
                    f"event type {kind!r} read at {event.path.text} must match "
                    f"{DEVICE_ID_RE.pattern}",
                )
            events.append({"type": kind, "value": item})
    return events


def _presence(
    mapping: CompiledMapping, captures: dict[str, str], payload: bytes, device: str | Refusal | None
) -> Mapped:
    document: Any = _ABSENT
    if mapping.presence_path is not None:
        try:
            document = msgspec.json.decode(payload)
        except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deep to read
            document = _ABSENT
    device_id = (
        device if device is not None else _device_id(mapping, mapping.presence_device, captures, {})
    )
    if isinstance(device_id, Refusal):
        return device_id
    if isinstance(document, dict) and mapping.presence_path is not None:
        value = mapping.presence_path.read(document)
        if isinstance(value, bool | int | float):
            # `online` and `offline` are strings: a JSON boolean or number ({"connected":
            # true}) is compared as its JSON text, as a bare payload `true` is.
            value = msgspec.json.encode(value).decode()
    else:
        value = payload.decode("utf-8", "replace").strip()
    records = mapping.presence_records
    if value == mapping.online:
        return MappedPresence(mapping.name, device_id, "online", captures, records)
    if value == mapping.offline:
        return MappedPresence(mapping.name, device_id, "offline", captures, records)
    return _refuse(
        mapping,
        MAPPING_UNKNOWN_PRESENCE,
        f"presence {str(value)[:80]!r} is neither {mapping.online!r} nor {mapping.offline!r}",
    )
