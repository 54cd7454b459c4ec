"""Every request and response body of the operator API, as msgspec Structs.

The OpenAPI document's schemas are generated from these types (Litestar's schema generation),
and their constraints are what the boundary enforces: a value the document allows is accepted,
and nothing the database cannot hold (a U+0000, an over-long string, a number out of range)
gets past them. Rows become Structs in one place, :func:`from_row`.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from litestar.openapi.spec import Reference, Schema
from litestar.openapi.spec.enums import OpenAPIType
from msgspec import UNSET, UnsetType

from gateway.domain.ai_task import RiskLevel, TaskStatus
from gateway.domain.alarm import (
    PERSON_ACTIONS,
    SYSTEM_ACTOR_PREFIX,
    Action,
    Alarm,
    AlarmStatus,
    Severity,
)
from gateway.domain.command import CommandStatus, Delivery, ReceiptOutcome, RejectReason
from gateway.domain.rules import RULE_KEY_PATTERN, ClockAdjustment
from protocol import MetricValue, ReceiptResult, is_valid_device_id, sparkplug
from protocol.ids import IDENTIFIER_PATTERN

ID_MAX: Final = 2**63 - 1  # bigint: a larger id would be a driver error, not a 400
ID_DIGITS_MAX: Final = len(str(ID_MAX))
ACTOR_MAX_LENGTH: Final = 128
NOTE_MAX_LENGTH: Final = 2000
NAME_MAX_LENGTH: Final = 128  # the command table's CHECK
IDEMPOTENCY_KEY_MAX_LENGTH: Final = 256
# Devices are small: a downlink's params beyond this are a mistake, not a command.
PARAMS_MAX_BYTES: Final = 65_536
LIMIT_DEFAULT: Final = 50
LIMIT_MAX: Final = 500
WAIT_MAX_S: Final = 60.0

# The patterns are read alike by Python's `re` (msgspec, at the boundary) and ECMA 262 (the
# document's readers): no `\s` (whose sets differ), no `\Z`; a closing `$` after a class that
# admits "\n" anyway. PostgreSQL's text cannot hold U+0000: no string admits it.
_NUL: Final = r"\u0000"
_SPACES: Final = (
    r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
)
NUL_FREE: Final = rf"^[^{_NUL}]*$"
NOT_BLANK: Final = rf"^[^{_NUL}]*[^{_SPACES}{_NUL}][^{_NUL}]*$"
# The protocol's and the rules' own patterns, with the closing `\Z` ECMA does not know as `$`
# (the classes admit no "\n", and the boundary checks device ids with the protocol's regex).
DEVICE_ID_PATTERN: Final = IDENTIFIER_PATTERN.removesuffix(r"\Z") + "$"
# Any device's id, a native one or a Sparkplug one (`{group}/{node}` for an edge node,
# `{group}/{node}/{device}` for a device: each level a native id, docs/sparkplug.md), as the
# command table's CHECK says it. It cannot travel in a path (`/` separates the levels, and the
# framework decodes `%2F` before routing): the routes that take one read it from the body or
# the query.
_IDENTIFIER_LEVEL: Final = IDENTIFIER_PATTERN.removeprefix("^").removesuffix(r"\Z")
ANY_DEVICE_ID_PATTERN: Final = rf"^{_IDENTIFIER_LEVEL}(/{_IDENTIFIER_LEVEL}){{0,2}}$"
ANY_DEVICE_ID_MAX_LENGTH: Final = 3 * 64 + 2
RULE_KEY_FILTER_PATTERN: Final = RULE_KEY_PATTERN.removesuffix(r"\Z") + "$"
# A device id, or a glob (at least one of `*?[`) of at most 128 characters: what the rules
# accept (gateway.domain.rules.device_selector), in a pattern both Python and ECMA 262 read alike.
DEVICE_SELECTOR_PATTERN: Final = (
    r"^([A-Za-z0-9_.:-]{1,64}|[A-Za-z0-9_.:\]!-]*[*?\[][A-Za-z0-9_.:*?\[\]!-]*)$"
)
DEVICE_SELECTOR_MAX_LENGTH: Final = 128
# The same with Sparkplug devices (a silence's `devices`, which the rules' selector matches,
# docs/sparkplug.md): also a Sparkplug id (`{group}/{node}[/{device}]`, each level a device id),
# and a glob may hold `/` (`Plant1/*`).
ANY_DEVICE_SELECTOR_PATTERN: Final = (
    r"^([A-Za-z0-9_.:-]{1,64}(/[A-Za-z0-9_.:-]{1,64}){0,2}"
    r"|[A-Za-z0-9_.:/\]!-]*[*?\[][A-Za-z0-9_.:/*?\[\]!-]*)$"
)
ANY_DEVICE_SELECTOR_MAX_LENGTH: Final = 3 * 64 + 2
# A selector in a query string (`GET /devices?selector=`, `GET /campaigns/targets?selector=`):
# comma-separated items, each a device id, or a glob (a `*`, `?` or `[` in its first 21
# characters); either way at most 64 characters. Every string the pattern admits is a selector
# the rules accept, so the document's readers and the server agree.
_SELECTOR_ID_ITEM: Final = r"[A-Za-z0-9_.:-]{1,64}"
_SELECTOR_GLOB_ITEM: Final = r"[A-Za-z0-9_.:!\]-]{0,20}[*?\[][A-Za-z0-9_.:*?!\[\]-]{0,43}"
_SELECTOR_ITEM: Final = rf"(?:{_SELECTOR_ID_ITEM}|{_SELECTOR_GLOB_ITEM})"
SELECTOR_ITEMS_MAX: Final = 32
SELECTOR_PATTERN: Final = rf"^{_SELECTOR_ITEM}(?:,{_SELECTOR_ITEM}){{0,{SELECTOR_ITEMS_MAX - 1}}}$"
# The same for the device list (`GET /devices?selector=`), which lists Sparkplug devices too:
# an item may also be a Sparkplug id (`{group}/{node}[/{device}]`, each level a device id), and
# a glob may hold `/` (`Plant1/*`), as the rules take them (docs/sparkplug.md).
_SELECTOR_ANY_ID_ITEM: Final = rf"{_SELECTOR_ID_ITEM}(?:/{_SELECTOR_ID_ITEM}){{0,2}}"
_SELECTOR_ANY_GLOB_ITEM: Final = r"[A-Za-z0-9_.:/!\]-]{0,20}[*?\[][A-Za-z0-9_.:/*?!\[\]-]{0,43}"
_SELECTOR_ANY_ITEM: Final = rf"(?:{_SELECTOR_ANY_ID_ITEM}|{_SELECTOR_ANY_GLOB_ITEM})"
ANY_SELECTOR_PATTERN: Final = (
    rf"^{_SELECTOR_ANY_ITEM}(?:,{_SELECTOR_ANY_ITEM}){{0,{SELECTOR_ITEMS_MAX - 1}}}$"
)

# The times the API takes: with a UTC offset, and not written on the first day of year 1 or the
# last day of year 9999. An offset (under 24 h) can push a time on either day out of the years
# 1 to 9999 that Python's datetime, and so the database driver, holds in UTC
# (`0001-01-01T00:00:00+01:00` is in year 0), which the driver cannot convert; and the driver
# writes those ends themselves as PostgreSQL's -infinity and infinity, read back as naive
# datetimes (answered without an offset), as protocol/messages.py says of device times. From the
# day after to the day before, every offset gives an instant the driver keeps. The document says
# so with a pattern, so that a time it allows is one the API takes: every time input is declared
# with :func:`time_schema` and checked with :func:`time_problem`.
TIME_PATTERN: Final = r"^(?!0001-01-01|9999-12-31)"
TIME_RANGE: Final = "from 0001-01-02 to 9999-12-30 as written"


def time_schema(description: str) -> dict[str, Any]:
    """A time's ``extra_json_schema``: its description and the pattern of :data:`TIME_RANGE`."""
    return {"description": description, "extra": {"pattern": TIME_PATTERN}}


def time_problem(value: datetime) -> str | None:
    """Why ``value`` is not a time the API takes (no UTC offset, or a day outside
    :data:`TIME_RANGE`), or None when it is one."""
    if value.utcoffset() is None:
        return "give a UTC offset (`Z` or `+hh:mm`)"
    if value.date() in (date.min, date.max):
        return (
            f"must be {TIME_RANGE}: with its offset, a time on 0001-01-01 or 9999-12-31 can "
            "fall outside the years 1 to 9999 in UTC, which the database driver cannot keep"
        )
    return None


NulFreeText = Annotated[str, msgspec.Meta(pattern=NUL_FREE)]
Actor = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=ACTOR_MAX_LENGTH,
        pattern=rf"^(?!{SYSTEM_ACTOR_PREFIX})" + NOT_BLANK.removeprefix("^"),
        description=f"The person acting: not blank; `{SYSTEM_ACTOR_PREFIX}` is the gateway's own.",
    ),
]
Note = Annotated[
    str, msgspec.Meta(max_length=NOTE_MAX_LENGTH, pattern=NUL_FREE, description="Free text.")
]
CommandName = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=NAME_MAX_LENGTH,
        pattern=NOT_BLANK,
        description="The command the device runs (not blank).",
    ),
]
IdempotencyKey = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=IDEMPOTENCY_KEY_MAX_LENGTH,
        pattern=NOT_BLANK,
        description="The same key again on the same device returns the first command.",
    ),
]

# `params` is any JSON object; the document says so recursively (no U+0000 in any key or
# string), which no Python type can spell: this schema is declared here, once, with the field.
JSON_VALUE: Final = "JsonValue"
_JSON_VALUE_REF: Final = Reference(ref=f"#/components/schemas/{JSON_VALUE}")
# As Litestar passes ``schema_extra`` through: plain JSON Schema.
_JSON_VALUE_REF_RAW: Final = {"$ref": f"#/components/schemas/{JSON_VALUE}"}
_NUL_FREE_STRING: Final = Schema(type=OpenAPIType.STRING, pattern=NUL_FREE)
JSON_VALUE_SCHEMA: Final = Schema(
    description="Any JSON value with no U+0000 in a key or a string (jsonb cannot hold it).",
    one_of=[
        Schema(type=OpenAPIType.NULL),
        Schema(type=OpenAPIType.BOOLEAN),
        Schema(type=OpenAPIType.NUMBER),
        _NUL_FREE_STRING,
        Schema(type=OpenAPIType.ARRAY, items=_JSON_VALUE_REF),
        Schema(
            type=OpenAPIType.OBJECT,
            property_names=_NUL_FREE_STRING,
            additional_properties=_JSON_VALUE_REF,
        ),
    ],
)
Params = Annotated[
    dict[str, Any],
    msgspec.Meta(
        extra_json_schema={
            "description": (
                f"Any JSON object of at most {PARAMS_MAX_BYTES} bytes, with no U+0000 anywhere "
                "(PostgreSQL's jsonb cannot hold it)."
            ),
            "extra": {
                "additional_properties": _JSON_VALUE_REF_RAW,
                "property_names": {"type": "string", "pattern": NUL_FREE},
            },
        }
    ),
]


def _has_nul(params: Any) -> bool:
    """Whether any key or string in ``params`` holds U+0000.

    Iterative: msgspec decodes nesting almost as deep as Python's recursion limit.
    """
    pending: list[Any] = [params]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return True
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False


# --- request bodies ----------------------------------------------------------------------------


class ActionBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /alarms/{id}/{action}``: why, and optionally who the caller says acts. The audit
    records the token's name as the actor; a stated ``actor`` is kept apart, untrusted
    (``stated_actor`` in the audit trail)."""

    actor: Actor | UnsetType = UNSET  # absent: nothing stated
    note: Note | None = None


AnyDeviceId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=ANY_DEVICE_ID_MAX_LENGTH,
        pattern=ANY_DEVICE_ID_PATTERN,
        description=(
            "The device: a native id, or a Sparkplug one (`{group}/{node}` for an edge node, "
            "`{group}/{node}/{device}` for a device)."
        ),
    ),
]


class CommandBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /devices/{id}/commands``: what to send, and how hard to try."""

    name: CommandName
    params: Params = msgspec.field(default_factory=dict)
    delivery: Delivery = Delivery.REALTIME
    idempotency_key: IdempotencyKey | None = None

    def __post_init__(self) -> None:
        # Raised here, msgspec reports these as ValidationErrors: the same 422 as the rest.
        if _has_nul(self.params):
            raise ValueError("params: U+0000 is not allowed in keys or strings")
        size = len(msgspec.json.encode(self.params))
        if size > PARAMS_MAX_BYTES:
            raise ValueError(f"params: {size} bytes as JSON, at most {PARAMS_MAX_BYTES}")


class DeviceCommandBody(CommandBody, forbid_unknown_fields=True, kw_only=True):
    """``POST /commands``: the same as ``POST /devices/{id}/commands``' body, with the device
    in it (the only way to name a Sparkplug device, whose id holds `/`)."""

    device_id: AnyDeviceId

    def __post_init__(self) -> None:
        super().__post_init__()
        # The pattern's `$` admits a closing "\n" in Python: the protocol's own checks decide.
        if not is_valid_device_id(self.device_id) and not sparkplug.is_device_key(self.device_id):
            raise ValueError(f"device_id: must match {ANY_DEVICE_ID_PATTERN}")

    def command(self) -> CommandBody:
        return CommandBody(
            name=self.name,
            params=self.params,
            delivery=self.delivery,
            idempotency_key=self.idempotency_key,
        )


# --- alarms ------------------------------------------------------------------------------------

PersonAction = Annotated[
    Action, msgspec.Meta(description=f"A person's action: {', '.join(sorted(PERSON_ACTIONS))}.")
]


class AiSummary(msgspec.Struct, kw_only=True):
    """The outcome of the latest summary attempt; payloads are in /summaries."""

    status: TaskStatus
    summary: str | None
    possible_cause: str | None
    inspection_suggestion: str | None
    risk_level: RiskLevel | None
    confidence: Annotated[float, msgspec.Meta(ge=0, le=1)] | None
    model_name: str
    prompt_version: str
    error_code: str | None
    attempt: Annotated[int, msgspec.Meta(ge=1)]
    finished_at: datetime | None


class AlarmView(Alarm, frozen=True, kw_only=True):
    """An alarm as the desk shows it (docs/behaviour.md §5, "States people can read"):
    ``active``: its condition is still true (not cleared; false: returned to normal);
    ``acknowledged``: a person took a step (confirmed, handled or judged it false);
    ``shelved_until``: until when it is shelved now (null: not shelved); ``out_of_service``:
    its device was out of service when it was raised (its notifications are suppressed)."""

    active: bool
    acknowledged: bool
    shelved_until: datetime | None = None
    out_of_service: bool = False


class AlarmDetail(AlarmView, frozen=True, kw_only=True):
    """An alarm with its latest AI summary attempt (null when there is none)."""

    ai_summary: AiSummary | None = None


class AlarmPage(msgspec.Struct, kw_only=True):
    items: list[AlarmView]
    next_before: int | None = None  # `before` for the next (older) page; null on the last


# --- the desk: counts, groups, bulk actions, shelves, out of service ---------------------------

BULK_ACTIONS: Final = (Action.CONFIRM, Action.FALSE, Action.CLOSE)
BulkAction = Literal["confirm", "false", "close"]
GroupBy = Literal["rule", "device"]
ShelvedFilter = Literal["false", "true", "any"]
SHELF_SECONDS_MAX: Final = 31_536_000.0  # a year: [alarms] shelve_max_s bounds it further
REASON_MAX_LENGTH: Final = 500
Reason = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=REASON_MAX_LENGTH,
        pattern=NOT_BLANK,
        description="Why (not blank).",
    ),
]
RuleKeyText = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=RULE_KEY_FILTER_PATTERN)
]


class StateCounts(msgspec.Struct, kw_only=True):
    """Open alarms in exclusive buckets (their sum is ``total``): shelved ones apart, the rest
    by active or returned to normal, acknowledged or not; ``out_of_service`` overlaps them (the
    open alarms raised while their device was out of service)."""

    total: int = 0
    active_unacknowledged: int = 0
    active_acknowledged: int = 0
    returned_unacknowledged: int = 0
    returned_acknowledged: int = 0
    shelved: int = 0
    out_of_service: int = 0


class AlarmCounts(msgspec.Struct, kw_only=True):
    """``GET /alarms/counts``: open alarms per severity (every severity listed), and all."""

    all: StateCounts
    by_severity: dict[Severity, StateCounts]


# The read a group was read in: PostgreSQL's snapshot (pg_snapshot as text,
# `xmin:xmax:xip,...`), `@`, and the read's time (microseconds since 1970): opaque to clients,
# who send it back as a bulk group's `as_of`.
SNAPSHOT_PATTERN: Final = r"^[0-9]{1,20}:[0-9]{1,20}:([0-9]{1,20}(,[0-9]{1,20})*)?@[0-9]{1,16}$"
SNAPSHOT_MAX_LENGTH: Final = 65_536


class AlarmGroup(msgspec.Struct, kw_only=True):
    key: str  # the rule key, or the device id
    count: int
    newest_at: datetime  # the newest alarm's trigger time
    newest_id: int
    worst_severity: Severity
    # The snapshot the group was read in: alarm ids commit out of order, so one below
    # `newest_id` may have been committed after this read; a bulk group's `as_of` leaves it be.
    as_of: Annotated[
        str,
        msgspec.Meta(
            description="The read this group was read in (opaque): send it back as a bulk "
            "group's `as_of`, with `newest_id` as its `up_to`."
        ),
    ]


class AlarmGroups(msgspec.Struct, kw_only=True):
    """Worst severity first, then newest first."""

    by: GroupBy
    items: list[AlarmGroup]
    # The keyset cursor (`?before=`): more groups follow; null on the last page.
    next_before: str | None = None


class AlarmFilters(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The list's filters, as ``GET /alarms`` takes them in its query."""

    status: list[AlarmStatus] | None = None
    device: AnyDeviceId | None = None
    rule: RuleKeyText | None = None
    open: bool = False
    active: bool | None = None
    cleared: bool | None = None
    acknowledged: bool | None = None
    shelved: ShelvedFilter = "false"
    severity: Severity | None = None


BULK_IDS_MAX: Final = 10_000
# JSON Schema's `integer` is any number without a fraction (`7.0` is one, and generators send
# it): an id in a body is read as a number that is a multiple of 1 (msgspec's `int` refuses
# `7.0`), at most 2**53 (where a float stops being exact), and made an int where it is used.
# The document calls it an integer (`complete_desk`). `7.5` is still a 422.
BODY_ID_MAX: Final = 2**53
BodyId = Annotated[float, msgspec.Meta(ge=1, le=BODY_ID_MAX, multiple_of=1)]


# A group's key: a rule key (at most 128 characters) or any device id, a Sparkplug one
# (`{group}/{node}/{device}`) up to ANY_DEVICE_ID_MAX_LENGTH, as GET /alarms/groups lists it.
GROUP_KEY_MAX_LENGTH: Final = max(ANY_DEVICE_ID_MAX_LENGTH, 128)


class BulkGroup(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A group of ``GET /alarms/groups``: its ``by``, its ``key``, the filters it was read with,
    and optionally its ``newest_id`` as read (``up_to``): the alarms raised since are not in
    the group the caller saw, and are left alone."""

    by: GroupBy
    key: Annotated[
        str, msgspec.Meta(min_length=1, max_length=GROUP_KEY_MAX_LENGTH, pattern=NOT_BLANK)
    ]
    filters: AlarmFilters = msgspec.field(default_factory=AlarmFilters)
    up_to: (
        Annotated[
            BodyId,
            msgspec.Meta(
                description="Only the group's alarms up to this id: its `newest_id` as "
                "`GET /alarms/groups` showed it (absent: the group as it is now)."
            ),
        ]
        | UnsetType
    ) = UNSET
    as_of: (
        Annotated[
            str,
            msgspec.Meta(
                pattern=SNAPSHOT_PATTERN,
                max_length=SNAPSHOT_MAX_LENGTH,
                description="Only the group's alarms as it was read: its `as_of` as "
                "`GET /alarms/groups` showed it. An alarm below `up_to` committed after that "
                "read (ids commit out of order), or that the read left out as shelved (its "
                "shelf lifted since), was seen by nobody in the group, and is left alone.",
            ),
        ]
        | UnsetType
    ) = UNSET


class BulkBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /alarms/bulk``: one person's action on the alarms ``ids``, or on every alarm of
    ``group`` (exactly one of the two: the document says so with ``oneOf``); ``note`` and
    ``actor`` as for one alarm's action."""

    action: BulkAction
    ids: Annotated[list[BodyId], msgspec.Meta(min_length=1, max_length=BULK_IDS_MAX)] | (
        UnsetType
    ) = UNSET
    group: BulkGroup | UnsetType = UNSET
    actor: Actor | UnsetType = UNSET
    note: Note | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ids, UnsetType) == isinstance(self.group, UnsetType):
            raise ValueError("give exactly one of `ids` and `group`")


# A bulk action's item for an alarm it did not act on: the action stopped at an earlier alarm
# (the database out of reach, or its change rolled back by a deadlock); its message says which.
BULK_NOT_ATTEMPTED: Final = "NOT_ATTEMPTED"


class BulkItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One alarm of a bulk action: ``ok`` with its ``status`` now, or the ``error`` code (as
    the single action would answer, ``AUDIT_FAILED`` and ``UNAVAILABLE`` included, or
    ``NOT_ATTEMPTED``) with ``message`` and, when it has one, ``current_status``; nothing of
    an alarm that is not ``ok`` changed, but for one with ``outcome_unknown``: the database
    went out of reach as its change was committed, which may have been made."""

    alarm_id: int
    ok: bool
    status: AlarmStatus | None = None
    error: (
        Annotated[
            str,
            msgspec.Meta(
                description=(
                    "The code `POST /alarms/{id}/{action}` would answer (`STATUS_CHANGED`, "
                    "`ILLEGAL_TRANSITION`, `NOT_FOUND`, `AUDIT_FAILED`: its audit row refused, "
                    "`UNAVAILABLE`: the database out of reach, or a deadlock...), or "
                    f"`{BULK_NOT_ATTEMPTED}`: not tried, the action stopped at an earlier "
                    "alarm (its `message` says why)."
                )
            ),
        ]
        | None
    ) = None
    message: str | None = None
    current_status: str | None = None
    outcome_unknown: Annotated[
        bool,
        msgspec.Meta(
            description="True: the database went out of reach as this alarm's change was "
            "committed (`UNAVAILABLE`): it may have been made; read the alarm before acting "
            "on it again. Absent otherwise."
        ),
    ] = False


class BulkResults(msgspec.Struct, kw_only=True):
    action: BulkAction
    done: int
    refused: int
    items: list[BulkItem]


ShelfSeconds = Annotated[
    float,
    msgspec.Meta(
        ge=1,
        le=SHELF_SECONDS_MAX,
        description="Seconds; at most `[alarms] shelve_max_s` (a longer one is a 400).",
    ),
]


class ShelveAlarmBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /alarms/{id}/shelve``: ``scope`` "alarm" shelves this alarm; "pair" shelves
    every alarm, present and future, of its rule on its device. For ``duration_s`` seconds."""

    scope: Literal["alarm", "pair"] = "alarm"
    duration_s: ShelfSeconds
    reason: Reason


class ShelvePairBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /shelves``: shelve every alarm, present and future, of ``rule_key`` on
    ``device_id`` (whether it has alarms yet or not), for ``duration_s`` seconds."""

    device_id: AnyDeviceId
    rule_key: RuleKeyText
    duration_s: ShelfSeconds
    reason: Reason

    def __post_init__(self) -> None:
        # The pattern's `$` admits a closing "\n" in Python: the protocol's own checks decide.
        if not is_valid_device_id(self.device_id) and not sparkplug.is_device_key(self.device_id):
            raise ValueError(f"device_id: must match {ANY_DEVICE_ID_PATTERN}")


class Shelf(msgspec.Struct, kw_only=True):
    """A shelf: in force from ``shelved_at`` until ``until``, or until it ended first
    (``ended_at``, ``ended_by``, ``end_reason``: lifted by a person, or expired)."""

    id: int
    scope: Literal["alarm", "pair"]
    alarm_id: int | None
    device_id: str
    rule_key: str
    reason: str
    shelved_by: str
    shelved_at: datetime
    until: datetime
    ended_at: datetime | None
    ended_by: str | None
    end_reason: Literal["expired", "lifted"] | None
    request_id: str | None


class ShelfPage(msgspec.Struct, kw_only=True):
    items: list[Shelf]
    next_before: int | None = None


class OutOfServiceBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``PUT /devices/{id}/out-of-service``: why, and until when (absent: until ended)."""

    reason: Reason
    until: (
        Annotated[
            datetime,
            msgspec.Meta(
                tz=True,
                extra_json_schema=time_schema(f"RFC 3339, with an offset; {TIME_RANGE}."),
            ),
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        problem = None if self.until is None else time_problem(self.until)
        if problem is not None:
            raise ValueError(f"until: {problem}")


class OutOfService(msgspec.Struct, kw_only=True):
    """A device's maintenance period: in force from ``since`` until ``until`` (null: until
    ended) or until it ended first (``ended_at``, ``ended_by``)."""

    id: int
    device_id: str
    reason: str
    set_by: str
    since: datetime
    until: datetime | None
    ended_at: datetime | None
    ended_by: str | None
    request_id: str | None


# The desk's request bodies (and the Structs inside them): each forbids unknown fields.
DESK_BODIES: Final = (
    AlarmFilters,
    BulkGroup,
    BulkBody,
    ShelveAlarmBody,
    ShelvePairBody,
    OutOfServiceBody,
)


def complete_desk(schemas: dict[str, Any]) -> None:
    """What Litestar's generation leaves out of the desk's bodies: ``ids``' items as the
    integers they are, with their bounds, and that a bulk body names exactly one of ``ids`` and
    ``group`` (two closed objects, one requiring each)."""
    group = schemas.get("BulkGroup")
    if group is not None and group.properties is not None and "up_to" in group.properties:
        described = group.properties["up_to"]
        group.properties["up_to"] = Schema(
            type=OpenAPIType.INTEGER,
            minimum=1,
            maximum=BODY_ID_MAX,
            description=getattr(described, "description", None),
        )
    body = schemas.get("BulkBody")
    if body is None or body.properties is None:
        return
    body.properties["ids"] = Schema(
        type=OpenAPIType.ARRAY,
        items=Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=BODY_ID_MAX),
        min_items=1,
        max_items=BULK_IDS_MAX,
        description=f"Alarm ids (at most `[alarms] bulk_max`, and {BULK_IDS_MAX}).",
    )
    branches = []
    for name, other in (("ids", "group"), ("group", "ids")):
        properties = {k: v for k, v in body.properties.items() if k != other}
        branches.append(
            Schema(
                type=OpenAPIType.OBJECT,
                properties=properties,
                required=["action", name],
                additional_properties=False,
            )
        )
    body.one_of = branches


class AllowedActions(msgspec.Struct, kw_only=True):
    """The people's actions allowed now (render buttons from this); a SUPERSEDED alarm has
    none, and ``superseded_by``."""

    status: AlarmStatus
    actions: list[PersonAction]
    superseded_by: int | UnsetType | None = UNSET


class Chain(msgspec.Struct, kw_only=True):
    """Oldest first: the alarm and every alarm it superseded, directly or not. A superseded
    alarm's chain is itself alone, with ``hint`` and ``superseded_by``."""

    items: list[AlarmView]
    hint: str | None = None
    superseded_by: int | UnsetType | None = UNSET


class AuditEntry(msgspec.Struct, kw_only=True):
    id: int
    actor: str  # the token's name, or `system:<what>`
    stated_actor: str | None  # what the caller wrote as the actor (untrusted), if anything
    action: str
    from_status: AlarmStatus | None
    to_status: AlarmStatus
    note: str | None
    request_id: str | None
    event_id: str | None
    node_id: str
    at: datetime


class AuditTrail(msgspec.Struct, kw_only=True):
    """Every change of the alarm, oldest first."""

    items: list[AuditEntry]


class SummaryAttempt(msgspec.Struct, kw_only=True):
    """One AI summary attempt; ``request_payload`` and ``raw_response`` for admins only."""

    id: int
    alarm_id: int
    attempt: int
    status: TaskStatus
    model_name: str
    prompt_version: str
    summary: str | None
    possible_cause: str | None
    inspection_suggestion: str | None
    risk_level: RiskLevel | None
    confidence: float | None
    error_code: str | None
    error_message: str | None
    claimed_by: str | None
    created_at: datetime
    next_attempt_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    request_payload: dict[str, Any] | UnsetType | None = UNSET
    raw_response: str | UnsetType | None = UNSET


class SummaryAttempts(msgspec.Struct, kw_only=True):
    """Every summary attempt, oldest first."""

    items: list[SummaryAttempt]


# --- commands ----------------------------------------------------------------------------------


class Command(msgspec.Struct, kw_only=True):
    """A downlink command (behaviour §7): every field always present; steps not taken are null.
    ``result``, ``result_code``, ``raw_result_code`` and ``raw_ack`` come from the receipt
    that decided the outcome; ``created_by`` is the token's name over this API."""

    id: int
    device_id: str
    name: str
    params: dict[str, Any]
    delivery: Delivery
    status: CommandStatus
    idempotency_key: str | None
    claim_generation: int
    claimed_node_id: str | None
    claimed_at: datetime | None
    lease_expire_at: datetime | None
    sent_at: datetime | None
    timeout_at: datetime | None
    expire_at: datetime
    next_attempt_at: datetime
    finished_at: datetime | None
    retry_count: int
    reclaim_count: int
    result: ReceiptResult | None
    result_code: int | None
    raw_result_code: str | None
    raw_ack: str | None
    created_at: datetime
    updated_at: datetime
    created_by: str | None
    campaign_id: int | None = None  # the campaign that made it, if one did


class CancelledCommand(Command, kw_only=True):
    """The command a cancel moved, with ``previous_status``, the status it left: what the
    cancel means for the device (`PENDING`: nothing was sent; `CLAIMED`: a downlink may be on
    its way; `SENT`: the broker took it, the device may carry it out)."""

    previous_status: CommandStatus


class Receipt(msgspec.Struct, kw_only=True):
    """A device's receipt as it came, kept whatever its outcome; ``node_id`` and
    ``claim_generation`` are what the device reported, ``received_by`` the node that judged
    it, ``reason`` why a rejected one was not applied."""

    id: int
    reported_command_id: int
    claim_generation: int | None
    node_id: str | None
    result: ReceiptResult
    result_code: int | None
    raw_result_code: str | None
    raw_ack: str | None
    outcome: ReceiptOutcome
    reason: RejectReason | None
    received_by: str
    received_at: datetime


class CommandCreated(msgspec.Struct, kw_only=True):
    command: Command
    created: bool  # false when the idempotency key named an existing command


class CommandDetail(msgspec.Struct, kw_only=True):
    command: Command
    receipts: list[Receipt]  # every receipt for the command, oldest first


class CommandPage(msgspec.Struct, kw_only=True):
    items: list[Command]
    next_before: int | None = None  # `before` for the next (older) page; null on the last


class Unbound(msgspec.Struct, kw_only=True):
    device_id: str
    cancelled: list[int]  # the open commands this unbinding cancelled


# --- devices ------------------------------------------------------------------------------------

Presence = Literal["online", "offline", "unknown"]


class Device(msgspec.Struct, kw_only=True):
    """A device the gateway has heard from; ``open_alarms`` counts its open alarms (NEW,
    PUSHED, DELAYED, CONFIRMED, ESCALATED: as ``GET /alarms?open=true``)."""

    device_id: str
    presence: Presence
    first_seen: datetime
    last_seen: datetime
    open_alarms: int


class DevicePage(msgspec.Struct, kw_only=True):
    """Devices by id, ascending. ``next_after`` is ``after`` for the next page (null on the
    last); a page may be shorter than ``limit`` and still have a next one (``selector``).
    ``devices`` is ``items`` again, kept for older clients (deprecated)."""

    items: list[Device]
    next_after: str | None = None
    devices: list[Device]


class LatestMetric(msgspec.Struct, kw_only=True):
    value: MetricValue
    ts: datetime  # the sample's device time


class LatestEvent(msgspec.Struct, kw_only=True):
    event: str  # the event's type
    ts: datetime  # the sample's device time


ClockReason = Annotated[
    str,
    msgspec.Meta(
        description=(
            "Why a sample was judged at another time than its own, or ordered by its `seq` "
            f"against it: {', '.join(a.value for a in ClockAdjustment)} "
            "(docs/rules-and-alarms.md, Device clocks)."
        )
    ),
]


class ClockAdjustmentSeen(msgspec.Struct, kw_only=True):
    """The device's last clock adjustment: when the batch that judged the sample ran
    (database time), why, the time the sample was sent with and the time it was judged at;
    ``skew_s`` is the difference (sent minus judged: positive, a clock ahead)."""

    received_at: datetime
    reason: ClockReason
    device_ts: datetime
    judged_ts: datetime
    skew_s: float


class DeviceClockFigures(msgspec.Struct, kw_only=True):
    """How often the device's samples were adjusted, per reason (every node's count, added
    up), and the last adjustment (null: never)."""

    adjustments: dict[ClockReason, int]
    last: ClockAdjustmentSeen | None = None


class DeviceDetail(Device, kw_only=True):
    """A device with its latest value of each metric and its latest events (newest first, at
    most 20), both from its newest samples, and its clock figures."""

    bound: bool
    out_of_service: OutOfService | None = None  # the maintenance period in force, if any
    latest_metrics: dict[str, LatestMetric]
    latest_events: list[LatestEvent]
    clock: DeviceClockFigures


class DeviceOne(msgspec.Struct, kw_only=True):
    device: DeviceDetail


class Sample(msgspec.Struct, kw_only=True):
    """One stored telemetry message: its device time, sequence, metrics and events as sent."""

    ts: datetime
    seq: int | None
    metrics: dict[str, MetricValue] | None
    events: list[dict[str, Any]] | None
    event_id: str


class SamplePage(msgspec.Struct, kw_only=True):
    """Newest first; ``next_before`` is ``before`` for the next (older) page, null on the last.
    ``samples`` is ``items`` again, kept for older clients (deprecated)."""

    items: list[Sample]
    next_before: str | None = None
    samples: list[Sample]


# --- dead letters -------------------------------------------------------------------------------


class DeadLetter(msgspec.Struct, kw_only=True):
    """A message that could not be ingested, kept with why (``reason``, ``detail``); ``size`` is
    the payload's size as it arrived, ``kept`` how many of its bytes were kept (fewer: it was
    truncated); the replay columns say what the last replay did. ``replayable`` is false for a
    letter no replay can ever ingest (truncated, ``MALFORMED``, ``BAD_DEVICE_ID``), with why in
    ``not_replayable_because`` (docs/api.md, Dead letters)."""

    id: int
    topic: str
    reason: str
    detail: str
    size: int
    kept: int
    received_at: datetime
    node_id: str
    replay_count: int
    replayed_at: datetime | None
    replay_outcome: str | None
    replayable: bool
    not_replayable_because: str | None


class DeadLetterDetail(DeadLetter, kw_only=True):
    """A dead letter with its payload as kept: ``payload_hex`` (every byte), and
    ``payload_text``, the bytes read as UTF-8 (null when they are not UTF-8: the hex has them),
    ``payload_sha256`` of the whole payload, how often it was seen and when last."""

    payload_hex: str
    payload_text: str | None
    payload_sha256: str
    seen_count: int
    last_seen_at: datetime


class DeadLetterPage(msgspec.Struct, kw_only=True):
    """Newest first (see `ListEnvelope`); ``dead_letters`` is ``items`` again, kept for clients
    written before the envelope was one shape (deprecated)."""

    items: list[DeadLetter]
    next_before: int | None = None  # `before` for the next (older) page; null on the last
    dead_letters: Annotated[list[DeadLetter], msgspec.Meta(extra_json_schema={"deprecated": True})]


class Replayed(msgspec.Struct, kw_only=True):
    """What a replay did: ``stored``, ``duplicate``, ``receipt``, ``presence`` (ingested,
    ``succeeded`` true), or ``still_invalid: <reason>``, ``truncated`` (not ingested, kept;
    ``succeeded`` false)."""

    dead_letter_id: int
    outcome: str
    succeeded: bool


class DeadLetterDiscarded(msgspec.Struct, kw_only=True):
    """A discarded dead letter: who discarded it (the token's name) and when."""

    dead_letter_id: int
    discarded_by: str
    discarded_at: datetime


# Properties kept under an old name for clients written before (docs/api.md, "Lists: one
# envelope"; /health's keys): the document marks them deprecated and says what replaced them.
DEPRECATED_PROPERTIES: Final[dict[str, dict[str, str]]] = {
    "DeadLetterPage": {"dead_letters": "items"},
    "DevicePage": {"devices": "items"},
    "SamplePage": {"samples": "items"},
}


# --- the alarm system's figures (GET /alarm-stats) ----------------------------------------------


class FigureThresholds(msgspec.Struct, kw_only=True):
    """The thresholds the figures were computed with ([alarms.figures])."""

    flood_alarms: int
    chatter_raises: int
    chatter_window_s: float
    stale_after_s: float
    target_per_10min: float


class IntervalCount(msgspec.Struct, kw_only=True):
    """Alarms raised in one fixed 10-minute interval (``starts_at`` on :00, :10, ... UTC); the
    first and the last intervals count only what falls inside the window."""

    starts_at: datetime
    alarms: int


class Per10Minutes(msgspec.Struct, kw_only=True):
    """``average``: the window's alarms per 10 minutes of it; ``peak``: the most in one
    interval; ``series``: every interval meeting the window, oldest first."""

    average: float
    peak: int
    series: list[IntervalCount]


class FloodPeriod(msgspec.Struct, kw_only=True):
    """Consecutive 10-minute intervals each holding more than ``flood_alarms`` alarms."""

    starts_at: datetime
    ends_at: datetime
    intervals: int
    alarms: int
    peak: int


class Floods(msgspec.Struct, kw_only=True):
    """``intervals`` in flood, and their ``share`` of the window's intervals (0 to 1)."""

    periods: list[FloodPeriod]
    intervals: int
    share: float


class ChatteringPair(msgspec.Struct, kw_only=True):
    """A (rule, device) that raised ``chatter_raises`` alarms or more within
    ``chatter_window_s``: its alarms in the window, the most within ``chatter_window_s``
    (``peak``), and the alarm with which it first reached the threshold (``since``)."""

    rule_key: str
    device_id: str
    alarms: int
    peak: int
    since: datetime


class Chattering(msgspec.Struct, kw_only=True):
    """``count``: every chattering pair; ``items``: the first 100, most chattering first."""

    count: int
    items: list[ChatteringPair]


class StaleAlarm(msgspec.Struct, kw_only=True):
    id: int
    device_id: str
    rule_key: str
    severity: str
    status: AlarmStatus
    triggered_at: datetime
    open_s: float


class Stale(msgspec.Struct, kw_only=True):
    """Open alarms raised more than ``stale_after_s`` ago, whatever the window: ``count``, and
    the 20 oldest."""

    count: int
    oldest: list[StaleAlarm]


class TopEntry(msgspec.Struct, kw_only=True):
    """A rule key or a device id, its alarms in the window and their share of all (0 to 1)."""

    key: str
    alarms: int
    share: float


class Acknowledgement(msgspec.Struct, kw_only=True):
    """Alarms whose first person's action (confirm, handle or false) was made in the window,
    and the seconds from their trigger to it: median, 90th percentile, longest (null: none)."""

    acknowledged: int
    median_s: float | None
    p90_s: float | None
    max_s: float | None


class OperatorFigures(msgspec.Struct, kw_only=True):
    """What one token (``actor``: its name) did in the window: people's actions, the alarms
    they touched, actions per 10 minutes (average, and the most in one interval), its
    acknowledgements and their median and 90th percentile seconds."""

    actor: str
    actions: int
    alarms: int
    per_10min: float
    peak_10min: int
    acknowledged: int
    ack_median_s: float | None
    ack_p90_s: float | None


class AlarmStats(msgspec.Struct, kw_only=True):
    """The alarm system's own figures over ``[since, until)`` (docs/alarm-figures.md)."""

    window: str
    window_s: float
    since: datetime
    until: datetime
    thresholds: FigureThresholds
    alarms: int
    per_10min: Per10Minutes
    floods: Floods
    chattering: Chattering
    stale: Stale
    top_rules: list[TopEntry]
    top_devices: list[TopEntry]
    acknowledgement: Acknowledgement
    operators: list[OperatorFigures]


# --- rows to Structs: the one place ------------------------------------------------------------


def exact(kind: str, **schema: Any) -> dict[str, Any]:
    """``schema_extra`` for a parameter: its schema as declared, not nullable (an absent
    parameter is how a caller says "none"), with bounds Litestar would drop or round (a
    minimum of 0, a maximum of 2**63 - 1 written as a float)."""
    return {"one_of": None, "type": kind, **schema}


T = TypeVar("T", bound=msgspec.Struct)
_JSONB: Final = ("params", "request_payload")


def from_row(kind: type[T], row: Any, *, leave_out: tuple[str, ...] = ()) -> T:
    """A Struct from a database row (a Record, a mapping or a storage row Struct): its fields
    by name, jsonb columns decoded; columns the Struct does not name, and ``leave_out``, are
    left out."""
    values = msgspec.structs.asdict(row) if isinstance(row, msgspec.Struct) else dict(row.items())
    for column in leave_out:
        values.pop(column, None)
    for column in _JSONB:
        if isinstance(values.get(column), str):
            values[column] = msgspec.json.decode(values[column])
    return msgspec.convert(values, kind, strict=False)


def summary_attempt(row: Any, *, with_payloads: bool) -> SummaryAttempt:
    hidden = () if with_payloads else ("request_payload", "raw_response")
    return from_row(SummaryAttempt, row, leave_out=hidden)
