"""Notification routes (behaviour §6): silences for operators, deliveries for everyone who
reads (a FAILED delivery says why in ``last_error``)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Final

import msgspec
import structlog
from litestar.openapi.spec import Schema
from litestar.openapi.spec.enums import OpenAPIType
from litestar.params import JSONBody, Parameter

from gateway.api.auth import CallDep, Role
from gateway.api.errors import ApiError, ErrorKind, invalid_body
from gateway.api.params import Before, Id, Limit, page
from gateway.api.routes import route
from gateway.api.schemas import (
    ANY_DEVICE_SELECTOR_MAX_LENGTH,
    ANY_DEVICE_SELECTOR_PATTERN,
    LIMIT_DEFAULT,
    NOTE_MAX_LENGTH,
    NUL_FREE,
    RULE_KEY_FILTER_PATTERN,
    TIME_RANGE,
    exact,
    from_row,
    time_problem,
    time_schema,
)
from gateway.api.services import Notifications
from gateway.domain.errors import ConfigError
from gateway.domain.notify import RECEIVER_NAME_PATTERN, DeliveryStatus
from gateway.domain.rules import SEVERITIES
from gateway.notify.service import DeliveryNotFoundError, SilenceNotFoundError

log = structlog.get_logger(__name__)


TAG: Final = "notifications"
SILENCE_NOT_FOUND: Final = ErrorKind(404, "NOT_FOUND", "no such silence")
DELIVERY_NOT_FOUND: Final = ErrorKind(404, "NOT_FOUND", "no such delivery")
MATCHERS_MAX: Final = 100
_EVENT_PATTERN: Final = r"^[a-z]+\.[a-z_]+$"

RuleKey = Annotated[str, msgspec.Meta(pattern=RULE_KEY_FILTER_PATTERN)]
DevicePattern = Annotated[
    str,
    msgspec.Meta(
        pattern=ANY_DEVICE_SELECTOR_PATTERN,
        max_length=ANY_DEVICE_SELECTOR_MAX_LENGTH,
        description="A device id (native or Sparkplug) or an fnmatch glob.",
    ),
]
SeverityName = Annotated[str, msgspec.Meta(pattern=r"^(" + "|".join(SEVERITIES) + r")$")]


class SilenceMatchers(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a silence matches; a matcher left out matches everything."""

    rules: Annotated[list[RuleKey], msgspec.Meta(min_length=1, max_length=MATCHERS_MAX)] | None = (
        None
    )
    devices: (
        DevicePattern
        | Annotated[list[DevicePattern], msgspec.Meta(min_length=1, max_length=MATCHERS_MAX)]
        | None
    ) = None
    severities: (
        Annotated[list[SeverityName], msgspec.Meta(min_length=1, max_length=len(SEVERITIES))] | None
    ) = None


class SilenceBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    ends_at: Annotated[
        datetime,
        msgspec.Meta(
            tz=True,
            extra_json_schema=time_schema(
                f"RFC 3339, with an offset; {TIME_RANGE}. A time already past ends the silence "
                "at once."
            ),
        ),
    ]
    matchers: SilenceMatchers = msgspec.field(default_factory=SilenceMatchers)
    comment: Annotated[str, msgspec.Meta(max_length=NOTE_MAX_LENGTH, pattern=NUL_FREE)] = ""

    def __post_init__(self) -> None:
        # Raised here, msgspec reports it as a ValidationError: the same 422 as the rest.
        problem = time_problem(self.ends_at)
        if problem is not None:
            raise ValueError(f"ends_at: {problem}")


class Silence(msgspec.Struct, kw_only=True):
    id: int
    matchers: SilenceMatchers
    starts_at: datetime
    ends_at: datetime
    comment: str
    created_by: str  # the name of the token that created it
    created_at: datetime
    expired_by: str | None  # the token that ended it early (DELETE), if one did
    active: bool


class SilencePage(msgspec.Struct, kw_only=True):
    items: list[Silence]
    next_before: int | None = None


class Delivery(msgspec.Struct, kw_only=True):
    id: int
    event_id: uuid.UUID  # the outbox event: X-Gateway-Event-Id
    outbox_id: int
    event: str
    receiver: str
    alarm_id: int | None
    device_id: str | None
    rule_key: str | None
    severity: str | None
    status: DeliveryStatus
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    silence_id: int | None
    suppressed: str | None = None  # SUPPRESSED: why ("shelved (shelf N)", "out of service")
    sent_by: str | None  # the node whose attempt the receiver accepted
    event_created_at: datetime
    created_at: datetime
    finished_at: datetime | None
    # INHIBITED: the open alarm that inhibited it, and the [[notify.inhibit]] rule's name.
    inhibited_by: int | None = None
    inhibit_rule: str | None = None
    # A grouped delivery (event notify.group): its group; the alarms it carries are in its body.
    group_id: int | None = None


class DeliveryDetail(Delivery, kw_only=True):
    body: dict[str, Any]  # what is sent


class DeliveryPage(msgspec.Struct, kw_only=True):
    items: list[Delivery]
    next_before: int | None = None


def _array(items: Schema, most: int) -> Schema:
    return Schema(
        one_of=[
            Schema(type=OpenAPIType.ARRAY, items=items, min_items=1, max_items=most),
            Schema(type=OpenAPIType.NULL),
        ]
    )


def complete(schemas: dict[str, Any]) -> None:
    """What Litestar's generation drops from `SilenceMatchers` (the items' patterns and
    bounds), declared here from the same constants the Struct uses."""
    device = Schema(
        type=OpenAPIType.STRING,
        pattern=ANY_DEVICE_SELECTOR_PATTERN,
        max_length=ANY_DEVICE_SELECTOR_MAX_LENGTH,
    )
    schemas["SilenceMatchers"] = Schema(
        type=OpenAPIType.OBJECT,
        title="SilenceMatchers",
        description="What a silence matches; a matcher left out (or null) matches everything.",
        properties={
            "rules": _array(
                Schema(type=OpenAPIType.STRING, pattern=RULE_KEY_FILTER_PATTERN), MATCHERS_MAX
            ),
            "devices": Schema(
                one_of=[
                    device,
                    Schema(
                        type=OpenAPIType.ARRAY, items=device, min_items=1, max_items=MATCHERS_MAX
                    ),
                    Schema(type=OpenAPIType.NULL),
                ]
            ),
            "severities": _array(
                Schema(type=OpenAPIType.STRING, enum=list(SEVERITIES)), len(SEVERITIES)
            ),
        },
        additional_properties=False,
    )


def _silence(row: Any) -> Silence:
    values = dict(row.items())
    values["matchers"] = msgspec.json.decode(values["matchers"])
    return msgspec.convert(values, Silence, strict=False)


_ID_PATH: Final = "{id:str}"


@route(
    "POST",
    "/silences",
    summary="Silence notifications that match, until `ends_at`",
    description=(
        "A silenced event still creates its deliveries, as `SILENCED` (visible, never sent). "
        "Silences never stop an alarm from being raised, escalated or audited. `created_by` is "
        "the token's name."
    ),
    operation_id="createSilence",
    tag=TAG,
    role=Role.OPERATOR,
    writes=True,
    body=True,
    status_code=201,
)
async def create_silence(
    notifications: Notifications, call: CallDep, data: JSONBody[SilenceBody]
) -> Silence:
    m = data.matchers
    try:
        row = await notifications.create_silence(
            rules=m.rules,
            devices=m.devices,
            severities=m.severities,
            ends_at=data.ends_at,
            comment=data.comment,
            created_by=call.caller.name,
        )
    except ConfigError as exc:
        raise invalid_body(str(exc)) from exc
    log.info("silence_created", silence_id=row["id"], token=call.caller.name)
    return _silence(row)


@route(
    "GET",
    "/silences",
    summary="Silences, newest first (keyset pagination by id)",
    operation_id="listSilences",
    tag=TAG,
    role=Role.VIEWER,
)
async def list_silences(
    notifications: Notifications,
    *,
    active: Annotated[bool, Parameter(description="Only those in force now.")] = False,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> SilencePage:
    rows = await notifications.silences(active_only=active, before=before, limit=limit + 1)
    items, next_before = page(rows, limit, _silence)
    return SilencePage(items=items, next_before=next_before)


@route(
    "DELETE",
    f"/silences/{_ID_PATH}",
    summary="End a silence now (an ended one is answered as it is)",
    operation_id="expireSilence",
    tag=TAG,
    role=Role.OPERATOR,
    writes=True,
    errors=[SILENCE_NOT_FOUND],
)
async def expire_silence(notifications: Notifications, call: CallDep, id: Id) -> Silence:
    try:
        row = await notifications.expire_silence(id, call.caller.name)
    except SilenceNotFoundError as exc:
        raise ApiError(SILENCE_NOT_FOUND, str(exc)) from exc
    log.info("silence_expired", silence_id=id, token=call.caller.name)
    return _silence(row)


@route(
    "GET",
    "/deliveries",
    summary="Notification deliveries, newest first (keyset pagination by id)",
    operation_id="listDeliveries",
    tag=TAG,
    role=Role.VIEWER,
)
async def list_deliveries(
    notifications: Notifications,
    *,
    status: Annotated[DeliveryStatus | None, Parameter(description="Only this status.")] = None,
    receiver: Annotated[
        str | None,
        Parameter(
            pattern=RECEIVER_NAME_PATTERN,
            schema_extra=exact("string"),
            description="Only this receiver.",
        ),
    ] = None,
    event: Annotated[
        str | None,
        Parameter(
            pattern=_EVENT_PATTERN,
            schema_extra=exact("string"),
            description="Only this event (`alarm.created`, `command.failed`, ...).",
        ),
    ] = None,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> DeliveryPage:
    rows = await notifications.deliveries(
        status=None if status is None else status.value,
        receiver=receiver,
        event=event,
        before=before,
        limit=limit + 1,
    )
    items, next_before = page(rows, limit, lambda r: from_row(Delivery, r))
    return DeliveryPage(items=items, next_before=next_before)


@route(
    "GET",
    f"/deliveries/{_ID_PATH}",
    summary="One delivery, with the body it sends",
    operation_id="getDelivery",
    tag=TAG,
    role=Role.VIEWER,
    errors=[DELIVERY_NOT_FOUND],
)
async def get_delivery(notifications: Notifications, id: Id) -> DeliveryDetail:
    try:
        row = await notifications.delivery(id)
    except DeliveryNotFoundError as exc:
        raise ApiError(DELIVERY_NOT_FOUND, str(exc)) from exc
    values = dict(row.items())
    values["body"] = msgspec.json.decode(values["body"])
    return msgspec.convert(values, DeliveryDetail, strict=False)


HANDLERS: Final = [create_silence, list_silences, expire_silence, list_deliveries, get_delivery]
