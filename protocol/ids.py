"""Device identifiers: the one grammar every id that reaches a topic must match."""

from __future__ import annotations

import re
from typing import Final

# `\Z`, not `$`: `$` also matches before a trailing newline, which would let "dev-1\n" through
# when a caller uses `.match` instead of `.fullmatch`.
IDENTIFIER_PATTERN: Final = r"^[A-Za-z0-9_.:-]{1,64}\Z"
DEVICE_ID_RE: Final[re.Pattern[str]] = re.compile(IDENTIFIER_PATTERN)


class InvalidDeviceIdError(ValueError):
    """A device id that does not match `DEVICE_ID_RE`; it must never be used to build a topic."""

    def __init__(self, device_id: str) -> None:
        super().__init__(f"invalid device id {device_id!r}: must match {DEVICE_ID_RE.pattern}")
        self.device_id = device_id

    def __reduce__(self) -> tuple[type[InvalidDeviceIdError], tuple[str]]:
        return (type(self), (self.device_id,))


def is_valid_device_id(value: str) -> bool:
    return DEVICE_ID_RE.fullmatch(value) is not None


def validate_device_id(value: str) -> str:
    if DEVICE_ID_RE.fullmatch(value) is None:
        raise InvalidDeviceIdError(value)
    return value
