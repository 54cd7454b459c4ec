"""The API's errors: each kind declares its HTTP status and code; one handler maps everything.

Every error leaves as :class:`ErrorBody` (``{"error": CODE, "message": ..., **details}``). A route
declares the kinds it can answer (see :mod:`gateway.api.routes`); the OpenAPI document lists
exactly those, and :func:`handle_exception` is the one place any exception becomes a response:
a declared kind as is, a domain error through :data:`_DOMAIN`, Litestar's own (router 404/405,
parameter validation, body size) in the same shape, a known database fault as 500
``AUDIT_FAILED`` or 503 ``UNAVAILABLE``, and anything else as 500 ``INTERNAL`` with a traceback
in the log (with the caller's credentials cut out of it).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import asyncpg
import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotFoundException,
    ValidationException,
)
from litestar.status_codes import HTTP_413_REQUEST_ENTITY_TOO_LARGE
from msgspec import UNSET, UnsetType

from gateway.alarms.lifecycle import AlarmNotFoundError, StatusChangedError
from gateway.alarms.service import AlarmHeldError, OutcomeUnknownError, TooManyAlarmsError
from gateway.alarms.shelving import (
    AlreadyShelvedError,
    DeviceNotFoundError,
    NotOutOfServiceError,
    ShelfEndedError,
    ShelfNotFoundError,
    ShelfTooLongError,
    UntilPastError,
)
from gateway.commands.campaigns import (
    CampaignChangedError,
    CampaignClosedError,
    CampaignNotFoundError,
    NoTargetsError,
    UnboundTargetsError,
)
from gateway.commands.lifecycle import (
    CommandChangedError,
    CommandClosedError,
    CommandNotFoundError,
    DeviceUnboundError,
    DownlinkTooLargeError,
    SparkplugWriteRefusedError,
)
from gateway.domain.alarm import (
    Alarm,
    AlarmSupersededError,
    IllegalTransitionError,
    InvalidActorError,
)
from gateway.domain.errors import ConcurrentWriteError, GatewayError
from gateway.support.log_limit import LogLimit
from protocol.ids import UnportableDeviceIdError
from storage.audit import audit_failure
from storage.errors import TRANSIENT_DB_ERRORS

log = structlog.get_logger(__name__)

REQUEST_ID_HEADER: Final = "X-Request-Id"
JSON: Final = "application/json"


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """One error a route can answer: its status, its stable code, and when it happens."""

    status: int
    code: str
    doc: str


# --- the kinds -------------------------------------------------------------------------------
BAD_REQUEST: Final = ErrorKind(
    400, "BAD_REQUEST", "a parameter or header is wrong (`param` names it)"
)
UNAUTHORIZED: Final = ErrorKind(
    401, "UNAUTHORIZED", "no bearer token, or an unknown one (`WWW-Authenticate` says which)"
)
FORBIDDEN: Final = ErrorKind(
    403, "FORBIDDEN", "the token's role is too weak (`required_role` names the one needed)"
)
ALARM_NOT_FOUND: Final = ErrorKind(404, "NOT_FOUND", "no such alarm (`alarm_id`)")
COMMAND_NOT_FOUND: Final = ErrorKind(404, "NOT_FOUND", "no such command (`command_id`)")
ROUTE_NOT_FOUND: Final = ErrorKind(404, "NOT_FOUND", "no such path")
DEVICE_NOT_FOUND: Final = ErrorKind(404, "NOT_FOUND", "no such device (`device_id`)")
DEAD_LETTER_NOT_FOUND: Final = ErrorKind(404, "NOT_FOUND", "no such dead letter (`dead_letter_id`)")
DEAD_LETTER_DISCARDED: Final = ErrorKind(
    409,
    "ALREADY_DISCARDED",
    "the dead letter was discarded already (`dead_letter_id`, `actor`: who, `discarded_at`); "
    "nothing is changed",
)
DEAD_LETTER_BUSY: Final = ErrorKind(
    409,
    "DEAD_LETTER_BUSY",
    "another transaction (a replay, the live path counting a repeat of its message, "
    "maintenance) holds the dead letter at this very moment (`dead_letter_id`); nothing is "
    "changed, retry",
)
REPLAY_CRASHED: Final = ErrorKind(
    422,
    "REPLAY_CRASHED",
    "the replay of a QUARANTINED letter runs in a process of its own, and that process ended "
    "without an outcome (`ended`: how, e.g. `killed by signal 11 (SIGSEGV)`; "
    "`dead_letter_id`): the cause is not fixed; nothing is changed, and the node goes on",
)
METHOD_NOT_ALLOWED: Final = ErrorKind(
    405, "METHOD_NOT_ALLOWED", "the path exists, the method does not (`Allow` lists them)"
)
ILLEGAL_TRANSITION: Final = ErrorKind(
    400,
    "ILLEGAL_TRANSITION",
    "the whitelist has no such step from the current status (`current_status`, `allowed`); "
    "nothing is changed",
)
COMMAND_CLOSED: Final = ErrorKind(
    400,
    "ILLEGAL_TRANSITION",
    "the command is terminal already (`current_status`, `command_id`); nothing is changed",
)
ALARM_SUPERSEDED: Final = ErrorKind(
    400,
    "ALARM_SUPERSEDED",
    "the alarm was superseded (`superseded_by`): it is handled through its successor",
)
STATUS_CHANGED: Final = ErrorKind(
    409,
    "STATUS_CHANGED",
    "someone changed the alarm's status first, between this request's read and its write "
    "(`current_status`; `actor`: who took this very step, `already confirmed by X`, else the "
    "person whose step the alarm is in now, null for a system's step; `alarm` as it is now); "
    "nothing is changed",
)
COMMAND_CHANGED: Final = ErrorKind(
    409,
    "STATUS_CHANGED",
    "someone changed the command first, between this request's read and its write "
    "(`current_status`, `actor`: the latest change's, `command_id`); nothing is changed",
)
DEVICE_UNBOUND: Final = ErrorKind(
    409, "DEVICE_UNBOUND", "the device is unbound (`device_id`); nothing is created"
)
DOWNLINK_TOO_LARGE: Final = ErrorKind(
    422,
    "DOWNLINK_TOO_LARGE",
    "the command's downlink cannot fit the broker's maximum packet size (`size`, `limit`: "
    "`[mqtt] max_packet_size`); nothing is created",
)
SPARKPLUG_WRITE_INVALID: Final = ErrorKind(
    422,
    "SPARKPLUG_WRITE_INVALID",
    'the params are no Sparkplug metric write (`{"value": v}`, optionally `"confirm"`), and '
    "the command goes to Sparkplug devices (`device_ids` names them all); nothing is created",
)
DEVICE_ID_NOT_PORTABLE: Final = ErrorKind(
    400,
    "BAD_DEVICE_ID",
    "the device id holds a `.`, which this broker maps to its own separator "
    "(`[mqtt] broker_family`; `device_id`); nothing is created",
)
CAMPAIGN_NOT_FOUND: Final = ErrorKind(404, "NOT_FOUND", "no such campaign (`campaign_id`)")
CAMPAIGN_CLOSED: Final = ErrorKind(
    400,
    "ILLEGAL_TRANSITION",
    "the campaign is closed already (`current_status`, `campaign_id`); nothing is changed",
)
CAMPAIGN_CHANGED: Final = ErrorKind(
    409,
    "STATUS_CHANGED",
    "someone closed the campaign first, between this request's read and its write "
    "(`current_status`, `actor`: who closed it, `campaign_id`); nothing is changed",
)
TARGETS_UNBOUND: Final = ErrorKind(
    409,
    "DEVICE_UNBOUND",
    "target devices are unbound (`device_ids` names them all); nothing is created",
)
NO_TARGETS: Final = ErrorKind(
    409, "NO_TARGETS", "the targets resolve to no device that takes commands; nothing is created"
)
CURSOR_AHEAD: Final = ErrorKind(
    400,
    "CURSOR_AHEAD",
    "`Last-Event-ID` (or `last_event_id`, `param` names it) is past every event written so far: "
    "no stream sent it",
)
TOO_MANY_STREAMS: Final = ErrorKind(
    429,
    "TOO_MANY_STREAMS",
    "this token has `[http] max_streams_per_token` streams open on this node; close one",
)
TOO_MANY_TICKETS: Final = ErrorKind(
    429,
    "TOO_MANY_TICKETS",
    "this token asked for stream tickets faster than the node grants them (`Retry-After`)",
)
STREAMS_FULL: Final = ErrorKind(
    503,
    "STREAMS_FULL",
    "this node has `[http] max_streams` streams open; retry later (`Retry-After`) or elsewhere",
)
SHELF_NOT_FOUND: Final = ErrorKind(404, "NOT_FOUND", "no such shelf (`shelf_id`)")
ALREADY_SHELVED: Final = ErrorKind(
    409,
    "ALREADY_SHELVED",
    "a shelf in force covers the same alarm or pair already (`shelf_id`); nothing is changed",
)
SHELF_ENDED: Final = ErrorKind(
    409,
    "SHELF_ENDED",
    "the shelf has ended already (`shelf_id`): lifted, or past its until (then recorded as "
    "expired, as the timers would, if none had yet); it is not lifted",
)
SHELF_TOO_LONG: Final = ErrorKind(
    400,
    "SHELF_TOO_LONG",
    "longer than `[alarms] shelve_max_s` (`limit`, in seconds); nothing is changed",
)
NOT_OUT_OF_SERVICE: Final = ErrorKind(
    409,
    "NOT_OUT_OF_SERVICE",
    "the device is not out of service (`device_id`); nothing is changed",
)
UNTIL_PAST: Final = ErrorKind(400, "UNTIL_PAST", "`until` is not in the future; nothing is changed")
TOO_MANY_ALARMS: Final = ErrorKind(
    400,
    "TOO_MANY_ALARMS",
    "more alarms than `[alarms] bulk_max` (`limit`) selected; nothing is done",
)
PAYLOAD_TOO_LARGE: Final = ErrorKind(413, "PAYLOAD_TOO_LARGE", "the body is too large")
INVALID_BODY: Final = ErrorKind(
    422,
    "INVALID_BODY",
    "the body is not JSON, not an object, misses a field, has unknown fields or values out of "
    "bounds (`detail` says what and where)",
)
INVALID_ACTOR: Final = ErrorKind(
    422, "INVALID_ACTOR", "the actor may not do this (`actor`, `reason`)"
)
AUDIT_FAILED: Final = ErrorKind(
    500,
    "AUDIT_FAILED",
    "PostgreSQL refused the change's audit row: the change was rolled back, nothing changed",
)
INTERNAL: Final = ErrorKind(500, "INTERNAL", "a server fault, logged as `api_error`")
UNAVAILABLE: Final = ErrorKind(
    503, "UNAVAILABLE", "the database is not reachable, or the node is still starting; retry"
)

# Outside any route's declaration: the router and the server answer these for every path.
UNROUTED: Final = frozenset({ROUTE_NOT_FOUND, METHOD_NOT_ALLOWED})


class ErrorBody(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The one error shape: `error` is a stable code, `message` a sentence for people; the
    other properties are details that some codes carry."""

    error: str
    message: str
    param: str | UnsetType = UNSET
    detail: str | UnsetType = UNSET
    alarm_id: int | UnsetType = UNSET
    command_id: int | UnsetType = UNSET
    dead_letter_id: int | UnsetType = UNSET
    campaign_id: int | UnsetType = UNSET
    shelf_id: int | UnsetType = UNSET
    device_id: str | UnsetType = UNSET
    device_ids: list[str] | UnsetType = UNSET
    current_status: str | UnsetType = UNSET
    action: str | UnsetType = UNSET
    allowed: list[str] | UnsetType = UNSET
    superseded_by: int | UnsetType | None = UNSET
    actor: str | UnsetType | None = UNSET
    alarm: Alarm | UnsetType = UNSET
    reason: str | UnsetType = UNSET
    required_role: str | UnsetType = UNSET
    size: int | UnsetType = UNSET
    limit: int | UnsetType = UNSET
    discarded_at: datetime | UnsetType = UNSET
    # How a process of the gateway's ended without an outcome (`REPLAY_CRASHED`).
    ended: str | UnsetType = UNSET
    # True: the database went out of reach as the change was committed; it may have been made.
    outcome_unknown: bool | UnsetType = UNSET


class ApiError(GatewayError):
    """An answer in the one error shape; ``details`` are :class:`ErrorBody` fields."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.headers = dict(headers or {})
        self.details = details

    def body(self) -> ErrorBody:
        return ErrorBody(error=self.kind.code, message=self.message, **self.details)


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(BAD_REQUEST, f"{param}: {message}", param=param)


def invalid_body(detail: str) -> ApiError:
    return ApiError(INVALID_BODY, "the request body does not fit", detail=detail)


# --- domain errors: their HTTP face, in one table ---------------------------------------------


def _status_changed(exc: StatusChangedError) -> ApiError:
    return ApiError(
        STATUS_CHANGED,
        str(exc),
        current_status=exc.current.status.value,
        actor=exc.actor,
        alarm=exc.current,
    )


def _illegal(exc: IllegalTransitionError) -> ApiError:
    return ApiError(
        ILLEGAL_TRANSITION,
        str(exc),
        current_status=exc.status.value,
        action=exc.action.value,
        allowed=[a.value for a in exc.allowed],
    )


_DOMAIN: Final[Mapping[type[Exception], Callable[[Any], ApiError]]] = {
    AlarmNotFoundError: lambda e: ApiError(ALARM_NOT_FOUND, str(e), alarm_id=e.alarm_id),
    AlarmSupersededError: lambda e: ApiError(
        ALARM_SUPERSEDED, str(e), superseded_by=e.superseded_by
    ),
    IllegalTransitionError: _illegal,
    StatusChangedError: _status_changed,
    InvalidActorError: lambda e: ApiError(INVALID_ACTOR, str(e), actor=e.actor, reason=e.reason),
    CommandNotFoundError: lambda e: ApiError(COMMAND_NOT_FOUND, str(e), command_id=e.command_id),
    DeviceUnboundError: lambda e: ApiError(DEVICE_UNBOUND, str(e), device_id=e.device_id),
    UnportableDeviceIdError: lambda e: ApiError(
        DEVICE_ID_NOT_PORTABLE, str(e), device_id=e.device_id
    ),
    SparkplugWriteRefusedError: lambda e: ApiError(
        SPARKPLUG_WRITE_INVALID, str(e), device_ids=e.device_ids
    ),
    DownlinkTooLargeError: lambda e: ApiError(
        DOWNLINK_TOO_LARGE, str(e), device_id=e.device_id, size=e.size, limit=e.limit
    ),
    CommandClosedError: lambda e: ApiError(
        COMMAND_CLOSED, str(e), command_id=e.command_id, current_status=e.status
    ),
    CommandChangedError: lambda e: ApiError(
        COMMAND_CHANGED, str(e), command_id=e.command_id, current_status=e.status, actor=e.actor
    ),
    CampaignChangedError: lambda e: ApiError(
        CAMPAIGN_CHANGED, str(e), campaign_id=e.campaign_id, current_status=e.status, actor=e.actor
    ),
    CampaignNotFoundError: lambda e: ApiError(
        CAMPAIGN_NOT_FOUND, str(e), campaign_id=e.campaign_id
    ),
    CampaignClosedError: lambda e: ApiError(
        CAMPAIGN_CLOSED, str(e), campaign_id=e.campaign_id, current_status=e.status
    ),
    UnboundTargetsError: lambda e: ApiError(TARGETS_UNBOUND, str(e), device_ids=e.device_ids),
    NoTargetsError: lambda e: ApiError(NO_TARGETS, str(e)),
    ShelfNotFoundError: lambda e: ApiError(SHELF_NOT_FOUND, str(e), shelf_id=e.shelf_id),
    AlreadyShelvedError: lambda e: ApiError(ALREADY_SHELVED, str(e), shelf_id=e.shelf_id),
    ShelfEndedError: lambda e: ApiError(SHELF_ENDED, str(e), shelf_id=e.shelf_id),
    ShelfTooLongError: lambda e: ApiError(SHELF_TOO_LONG, str(e), limit=int(e.limit)),
    DeviceNotFoundError: lambda e: ApiError(DEVICE_NOT_FOUND, str(e), device_id=e.device_id),
    NotOutOfServiceError: lambda e: ApiError(NOT_OUT_OF_SERVICE, str(e), device_id=e.device_id),
    UntilPastError: lambda e: ApiError(UNTIL_PAST, str(e)),
    TooManyAlarmsError: lambda e: ApiError(TOO_MANY_ALARMS, str(e), limit=e.limit),
    AlarmHeldError: lambda e: ApiError(UNAVAILABLE, str(e), alarm_id=e.alarm_id),
    OutcomeUnknownError: lambda e: ApiError(
        UNAVAILABLE, str(e), alarm_id=e.alarm_id, outcome_unknown=True
    ),
    # Another node wrote the same alarm or state in the same moment, again at every attempt
    # the caller made: nothing was changed, and a retry sees that write.
    ConcurrentWriteError: lambda e: ApiError(UNAVAILABLE, f"{e}; nothing was changed, retry"),
}


def from_domain(exc: BaseException) -> ApiError | None:
    """The HTTP face of a domain error; None for anything that is not one."""
    for kind in type(exc).__mro__:
        convert = _DOMAIN.get(kind)
        if convert is not None:
            return convert(exc)
    return None


# A database that cannot be reached is a temporary fault (503), not a bug (500).
_UNAVAILABLE: Final = TRANSIENT_DB_ERRORS


def _param_of(request: Request[Any, Any, Any], key: str, source: str) -> str:
    """The name a caller used for a parameter Litestar reports by its Python name."""
    if source != "header":
        handler: Any = request.scope.get("route_handler")
        fields = {} if handler is None else handler.parsed_fn_signature.parameters
        field = fields.get(key)
        query = getattr(getattr(field, "kwarg_definition", None), "query", None)
        return query or key
    return REQUEST_ID_HEADER if key == "request_id" else key


def _from_litestar(request: Request[Any, Any, Any], exc: HTTPException) -> ApiError:  # noqa: PLR0911 - one return per kind
    if isinstance(exc, ValidationException):
        problems = exc.extra if isinstance(exc.extra, list) else []
        first = problems[0] if problems and isinstance(problems[0], dict) else {}
        source = str(getattr(first.get("source"), "value", first.get("source", "")))
        message = str(first.get("message", exc.detail))
        if source == "body" or not first:
            return invalid_body(message)
        return bad_request(_param_of(request, str(first.get("key")), source), message)
    if isinstance(exc, NotFoundException):
        return ApiError(ROUTE_NOT_FOUND, f"no route {request.method} {request.url.path[:200]}")
    if isinstance(exc, MethodNotAllowedException):
        headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"}
        return ApiError(
            METHOD_NOT_ALLOWED, f"{request.method} is not allowed here", headers=headers
        )
    if exc.status_code == HTTP_413_REQUEST_ENTITY_TOO_LARGE:
        return ApiError(PAYLOAD_TOO_LARGE, "the request body is too large")
    if exc.status_code < 500:
        return bad_request("request", str(exc.detail)[:200])
    # The client went away mid-body, and the like: no one reads this answer.
    log.warning(
        "api_request_failed",
        method=request.method,
        path=request.url.path[:200],
        status=exc.status_code,
        error=str(exc.detail)[:200],
    )
    return ApiError(INTERNAL, "internal error; see the gateway's log")


def _redacted_traceback(exc: BaseException, request: Request[Any, Any, Any]) -> str:
    """The traceback, less anything the caller sent as credentials."""
    text = "".join(traceback.format_exception(exc))
    authorization = request.headers.get("authorization", "")
    for secret in {authorization, *authorization.split()}:
        if len(secret) >= 8:
            text = text.replace(secret, "[redacted]")
    return text


def unavailable_reason(exc: BaseException) -> str:
    """Why a transient database fault (``storage.errors.TRANSIENT_DB_ERRORS``) stopped a
    change, truthfully: a deadlock or a held row is the database's answer, not its absence.
    Also why a bulk action stopped at an alarm whose audit (or outbox) table was held."""
    if isinstance(exc, AlarmHeldError) and exc.held_table is not None:
        # The audit row's table, or the event's: every alarm's would wait for it alike.
        what = "audit row" if exc.table is not None else "event"
        return (
            f"its {what} waited for the {exc.held_table} table, held by another transaction "
            f"(a schema change, an index being built?), as every alarm's {what} would"
        )
    if isinstance(exc, asyncpg.exceptions.LockNotAvailableError):
        return "a row this change needs is held by another transaction"
    if isinstance(exc, asyncpg.exceptions.QueryCanceledError):
        return (
            "the database cancelled a statement of this change (a statement_timeout, or a "
            "cancel request)"
        )
    if isinstance(exc, asyncpg.exceptions.DeadlockDetectedError):
        return "the database rolled the change back: a deadlock with another transaction"
    if isinstance(exc, asyncpg.exceptions.TransactionRollbackError):
        return "the database rolled the change back: a conflict with another transaction"
    return "the database is not reachable"


def to_api_error(request: Request[Any, Any, Any], exc: BaseException) -> ApiError:
    """Any exception as an :class:`ApiError`; unexpected ones are logged here."""
    if isinstance(exc, ApiError):
        return exc
    domain = from_domain(exc)
    if domain is not None:
        return domain
    if isinstance(exc, HTTPException):
        return _from_litestar(request, exc)
    path = request.url.path[:200]
    table = audit_failure(exc)
    if table is not None:
        # A known fault with a known effect: no traceback, the daemon logged the row's error.
        log.error(
            "api_audit_failed", method=request.method, path=path, table=table, error=repr(exc)[:500]
        )
        return ApiError(
            AUDIT_FAILED,
            "the change was rolled back: its audit row could not be written; see the gateway's log",
        )
    if isinstance(exc, _UNAVAILABLE):
        # A row held by another transaction past a change's lock wait (a node stopped
        # mid-change), a deadlock, or a statement the database cancelled (a statement_timeout
        # set on the role or the database): the database answered, and nothing changed.
        held = isinstance(exc, asyncpg.exceptions.LockNotAvailableError)
        rolled_back = isinstance(
            exc,
            (asyncpg.exceptions.TransactionRollbackError, asyncpg.exceptions.QueryCanceledError),
        )
        log.warning(
            "api_row_held" if held else "api_database_unavailable",
            method=request.method,
            path=path,
            error=repr(exc)[:500],
        )
        reason = unavailable_reason(exc)
        return ApiError(
            UNAVAILABLE,
            f"{reason}; nothing changed, retry" if held or rolled_back else f"{reason}; retry",
        )
    log.error(
        "api_error",
        method=request.method,
        path=path,
        error=type(exc).__name__,
        traceback=_redacted_traceback(exc, request),
    )
    return ApiError(INTERNAL, "internal error; see the gateway's log")


def declared_kinds(request: Request[Any, Any, Any]) -> frozenset[ErrorKind] | None:
    handler: Any = request.scope.get("route_handler")
    if handler is None:
        return None
    kinds = handler.opt.get("errors")
    return kinds if isinstance(kinds, frozenset) else None


_undeclared: Final = LogLimit(lines=10, interval_s=60.0)


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorBody]:
    """The one exception handler: every error response of the app is made here."""
    error = to_api_error(request, exc)
    declared = declared_kinds(request)
    if declared is not None and error.kind not in declared and error.kind not in UNROUTED:
        # The document would not list this answer: a bug to fix in the route's declaration.
        # A request can cause it as often as it likes: at most a few lines a minute.
        suppressed = _undeclared.take()
        if suppressed is not None:
            log.error(
                "api_undeclared_error",
                method=request.method,
                path=request.url.path[:200],
                status=error.kind.status,
                code=error.kind.code,
                suppressed=suppressed,
            )
    return Response(
        error.body(), status_code=error.kind.status, headers=error.headers, media_type=JSON
    )


def by_status(kinds: Iterable[ErrorKind]) -> dict[int, list[ErrorKind]]:
    grouped: dict[int, list[ErrorKind]] = {}
    for kind in sorted(kinds, key=lambda k: (k.status, k.code, k.doc)):
        grouped.setdefault(kind.status, []).append(kind)
    return grouped
