"""Device identifiers: the one grammar every id that reaches a topic must match.

A `.` is allowed, as it always was; but RabbitMQ and NATS map `.` in an MQTT topic to their own
separators (docs/deploying.md): there, an id with a `.` is not a topic level any more. A
deployment on those brokers says so (`[mqtt] broker_family`) and then ids must also be
*portable*: the same grammar without `.` (`is_portable_device_id`)."""

from __future__ import annotations

import re
from typing import Final

# `\Z`, not `$`: `$` also matches before a trailing newline, which would let "dev-1\n" through
# when a caller uses `.match` instead of `.fullmatch`.
IDENTIFIER_PATTERN: Final = r"^[A-Za-z0-9_.:-]{1,64}\Z"
DEVICE_ID_RE: Final[re.Pattern[str]] = re.compile(IDENTIFIER_PATTERN)
# Where brokers map `.` (RabbitMQ, NATS), an id must not hold one.
NOT_PORTABLE: Final = "."


class InvalidDeviceIdError(ValueError):
    """A device id that does not match `DEVICE_ID_RE`; it must never be used to build a topic."""

    def __init__(self, device_id: str) -> None:
        super().__init__(f"invalid device id {device_id!r}: must match {DEVICE_ID_RE.pattern}")
        self.device_id = device_id

    def __reduce__(self) -> tuple[type[InvalidDeviceIdError], tuple[str]]:
        return (type(self), (self.device_id,))


class UnportableDeviceIdError(InvalidDeviceIdError):
    """A valid device id holding a `.`, on a broker that maps `.` to its own separator."""

    def __init__(self, device_id: str) -> None:
        ValueError.__init__(
            self,
            f"device id {device_id!r} holds a `.`, which this broker ([mqtt] broker_family) "
            "maps to its own separator: use ids without `.`",
        )
        self.device_id = device_id


def is_portable_device_id(value: str) -> bool:
    """Valid, and carried unchanged by every broker: no `.` (see the module)."""
    return NOT_PORTABLE not in value and DEVICE_ID_RE.fullmatch(value) is not None


def is_valid_device_id(value: str) -> bool:
    return DEVICE_ID_RE.fullmatch(value) is not None


def validate_device_id(value: str) -> str:
    if DEVICE_ID_RE.fullmatch(value) is None:
        raise InvalidDeviceIdError(value)
    return value
