"""MQTT topic names: building them from validated parts and parsing inbound device topics."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final, Literal

from protocol.events import Aggregate
from protocol.ids import DEVICE_ID_RE, NOT_PORTABLE, UnportableDeviceIdError, validate_device_id

TopicErrorCode = Literal["BAD_TOPIC", "BAD_DEVICE_ID"]


class TopicKind(enum.StrEnum):
    TELEMETRY = "telemetry"
    ACKS = "acks"
    COMMANDS = "commands"
    STATUS = "status"


_KINDS: Final[dict[str, TopicKind]] = {kind.value: kind for kind in TopicKind}
# NUL is forbidden in MQTT topic names; the wildcards and `/` would change the topic's shape.
_FORBIDDEN_IN_LEVEL: Final = frozenset("/+#\x00")


class TopicError(ValueError):
    """An inbound topic that is not `{prefix}/devices/{device_id}/{kind}`."""

    def __init__(self, code: TopicErrorCode, topic: str, detail: str) -> None:
        super().__init__(f"{code}: {detail} (topic {topic!r})")
        self.code: TopicErrorCode = code
        self.topic = topic
        self.detail = detail

    def __reduce__(self) -> tuple[type[TopicError], tuple[TopicErrorCode, str, str]]:
        return (type(self), (self.code, self.topic, self.detail))


@dataclass(frozen=True, slots=True)
class DeviceTopic:
    kind: TopicKind
    device_id: str


def _validate_prefix(prefix: str) -> None:
    if not prefix:
        raise ValueError("topic prefix must not be empty")
    if "+" in prefix or "#" in prefix or "\x00" in prefix:
        raise ValueError(f"topic prefix {prefix!r} must not contain `+`, `#` or NUL")
    if prefix.startswith(("$", "/")):
        # `$`-topics are reserved for the broker; a leading `/` makes an empty first level.
        raise ValueError(f"topic prefix {prefix!r} must not start with `$` or `/`")
    if prefix.endswith("/"):
        raise ValueError(f"topic prefix {prefix!r} must not end with `/`")
    if "//" in prefix:
        raise ValueError(f"topic prefix {prefix!r} must not contain an empty level")


def _validate_level(what: str, value: str) -> str:
    if not value or not _FORBIDDEN_IN_LEVEL.isdisjoint(value):
        raise ValueError(f"{what} {value!r} must be non-empty and contain no `/`, `+`, `#` or NUL")
    return value


@dataclass(frozen=True, slots=True)
class Topics:
    """Every topic name the gateway publishes to, subscribes to or parses, under one prefix.

    ``portable_ids``: the broker maps `.` to its own separator (RabbitMQ, NATS): a device id
    holding one is refused both ways (``UnportableDeviceIdError`` building a topic,
    ``BAD_DEVICE_ID`` parsing one), never passed to the broker to lose."""

    prefix: str = "iot"
    portable_ids: bool = False
    _devices: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate_prefix(self.prefix)
        object.__setattr__(self, "_devices", f"{self.prefix}/devices/")

    def _device_topic(self, device_id: str, kind: TopicKind) -> str:
        validate_device_id(device_id)
        if self.portable_ids and NOT_PORTABLE in device_id:
            raise UnportableDeviceIdError(device_id)
        return f"{self._devices}{device_id}/{kind.value}"

    def telemetry(self, device_id: str) -> str:
        return self._device_topic(device_id, TopicKind.TELEMETRY)

    def acks(self, device_id: str) -> str:
        return self._device_topic(device_id, TopicKind.ACKS)

    def commands(self, device_id: str) -> str:
        return self._device_topic(device_id, TopicKind.COMMANDS)

    def device_status(self, device_id: str) -> str:
        return self._device_topic(device_id, TopicKind.STATUS)

    def event(self, aggregate: str, aggregate_id: str) -> str:
        """``{prefix}/events/{aggregate}/{id}``. A device's events under a Sparkplug id
        (``{group}/{node}`` or ``{group}/{node}/{device}``, each level a device id) take as many
        levels as it has."""
        _validate_level("event aggregate", aggregate)
        levels = aggregate_id.split("/")
        if (
            aggregate != Aggregate.DEVICE
            or len(levels) not in (2, 3)
            or any(DEVICE_ID_RE.fullmatch(level) is None for level in levels)
        ):
            _validate_level("event aggregate id", aggregate_id)
        return f"{self.prefix}/events/{aggregate}/{aggregate_id}"

    def gateway_status(self, node_id: str) -> str:
        if DEVICE_ID_RE.fullmatch(node_id) is None:
            raise ValueError(f"invalid node id {node_id!r}: must match {DEVICE_ID_RE.pattern}")
        return f"{self.prefix}/gateways/{node_id}/status"

    def subscription(self, kind: TopicKind, shared_group: str | None = None) -> str:
        topic_filter = f"{self._devices}+/{TopicKind(kind).value}"
        if shared_group is None:
            return topic_filter
        _validate_level("shared subscription group", shared_group)
        return f"$share/{shared_group}/{topic_filter}"

    def parse_device_topic(self, topic: str) -> DeviceTopic:
        """Split an inbound topic (see `split_device_topic`)."""
        kind, device_id = self.split_device_topic(topic)
        return DeviceTopic(kind, device_id)

    def split_device_topic(self, topic: str) -> tuple[TopicKind, str]:
        """An inbound topic's kind and device id, or `TopicError`. Runs once per message:
        plain string operations only, and a plain tuple back (building a frozen dataclass
        took longer than the checks: 1.3 against 0.05 µs for the tuple, measured here)."""
        if not topic.startswith(self._devices):
            raise TopicError(
                "BAD_TOPIC", topic, f"expected `{self._devices}{{device_id}}/{{kind}}`"
            )
        # Device ids contain no `/`, so the first `/` after the prefix ends the id; anything
        # left with another `/` (extra levels) is not a known kind.
        device_id, slash, kind_text = topic[len(self._devices) :].partition("/")
        kind = _KINDS.get(kind_text) if slash else None
        if kind is None:
            raise TopicError(
                "BAD_TOPIC",
                topic,
                f"expected `{self._devices}{{device_id}}/{{kind}}` "
                f"with kind one of {', '.join(_KINDS)}",
            )
        if DEVICE_ID_RE.fullmatch(device_id) is None:
            raise TopicError(
                "BAD_DEVICE_ID", topic, f"device id {device_id!r} must match {DEVICE_ID_RE.pattern}"
            )
        if self.portable_ids and NOT_PORTABLE in device_id:
            raise TopicError(
                "BAD_DEVICE_ID",
                topic,
                f"device id {device_id!r} holds a `.`, which this broker ([mqtt] broker_family) "
                "maps to its own separator",
            )
        return kind, device_id


def unshared(topic_filter: str) -> str:
    """``topic_filter`` without its ``$share/<group>/`` prefix (as is without one): the filter
    a shared subscription matches topics by (`Topics.subscription` adds the prefix)."""
    if topic_filter.startswith("$share/"):
        return topic_filter.split("/", 2)[2]
    return topic_filter
