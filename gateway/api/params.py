"""The parameters the route modules share: a page's size and keyset cursor, device and record
ids in the path, and the one keyset paging step (:func:`page`).

Route modules import these from here (and bodies from ``schemas``), never from each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Protocol, TypeVar, overload

from litestar.params import Parameter

from gateway.api.errors import bad_request
from gateway.api.schemas import (
    ANY_DEVICE_ID_MAX_LENGTH,
    ANY_DEVICE_ID_PATTERN,
    DEVICE_ID_PATTERN,
    ID_MAX,
    LIMIT_MAX,
    exact,
)
from gateway.domain.command import CommandStatus
from protocol import is_valid_device_id, sparkplug

__all__ = [
    "AlarmId",
    "AnyDeviceId",
    "AnyDeviceIdFilter",
    "Before",
    "CampaignId",
    "CommandId",
    "CommandStatusFilter",
    "DeadLetterId",
    "DeviceId",
    "Id",
    "Limit",
    "any_device_id",
    "page",
]


def _id(description: str) -> Any:
    """A positive bigint in the path, documented as exactly that."""
    return Parameter(
        ge=1,
        le=ID_MAX,
        schema_extra=exact("integer", format="int64", minimum=1, maximum=ID_MAX),
        description=description,
    )


Limit = Annotated[int, Parameter(ge=1, le=LIMIT_MAX, description="Page size.")]
Before = Annotated[int | None, _id("Keyset cursor: only older ones (`next_before`).")]
DeviceId = Annotated[
    str,
    Parameter(
        pattern=DEVICE_ID_PATTERN,
        min_length=1,
        max_length=64,
        description="Device id (anything else is a 400).",
    ),
]
AnyDeviceId = Annotated[
    str,
    Parameter(
        pattern=ANY_DEVICE_ID_PATTERN,
        min_length=1,
        max_length=ANY_DEVICE_ID_MAX_LENGTH,
        schema_extra=exact("string"),
        description="The device: a native or a Sparkplug id (`{group}/{node}[/{device}]`).",
    ),
]
"""A device named in the query (``?id=``): the routes that must name any device, a Sparkplug
one included, whose ``/`` no path can carry (an encoded ``%2F`` is decoded before routing)."""
AnyDeviceIdFilter = Annotated[
    str | None,
    Parameter(
        pattern=ANY_DEVICE_ID_PATTERN,
        min_length=1,
        max_length=ANY_DEVICE_ID_MAX_LENGTH,
        schema_extra=exact("string"),
        description=(
            "Only this device's: a native id or a Sparkplug one (`{group}/{node}[/{device}]`)."
        ),
    ),
]
AlarmId = Annotated[int, _id("Alarm id (anything but a positive integer is a 400).")]
CommandId = Annotated[int, _id("Command id (anything but a positive integer is a 400).")]
CampaignId = Annotated[int, _id("Campaign id (anything but a positive integer is a 400).")]
DeadLetterId = Annotated[int, _id("Dead letter id (anything but a positive integer is a 400).")]
Id = Annotated[int, _id("Id (anything but a positive integer is a 400).")]
CommandStatusFilter = Annotated[
    CommandStatus | None, Parameter(description="Only commands in this status.")
]


def any_device_id(id: str, param: str = "id") -> str:
    """``id`` (an :data:`AnyDeviceId`) if it is a native or a Sparkplug id, else a 400."""
    if not is_valid_device_id(id) and not sparkplug.is_device_key(id):
        # The pattern's `$` admits a closing "\n" in Python: the protocol's checks decide.
        raise bad_request(param, f"must match {ANY_DEVICE_ID_PATTERN}")
    return id


class _Identified(Protocol):
    @property
    def id(self) -> int: ...


Item = TypeVar("Item", bound=_Identified)
Row = TypeVar("Row")


@overload
def page(found: Sequence[Item], limit: int) -> tuple[list[Item], int | None]: ...
@overload
def page(
    found: Sequence[Row], limit: int, item: Callable[[Row], Item]
) -> tuple[list[Item], int | None]: ...
def page(
    found: Sequence[Any], limit: int, item: Callable[[Any], Any] | None = None
) -> tuple[list[Any], int | None]:
    """Keyset paging, newest first: the page of ``found`` (read with ``limit + 1``), each made
    an ``item``, and ``next_before``, the cursor of the next (older) page: the id of the page's
    last item, or None when this page is the last."""
    kept = list(found[:limit]) if item is None else [item(row) for row in found[:limit]]
    return kept, kept[-1].id if len(found) > limit else None
