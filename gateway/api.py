"""The operator HTTP API for alarms (SPEC §9): bearer tokens with roles, one error shape.

Every error, whatever raised it, leaves as ``{"error": CODE, "message": ..., **details}``.
Bad input is a 4xx naming what was wrong; only a server fault is a 5xx.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Any, Final

import asyncpg
import msgspec
import structlog
from aiohttp import web
from multidict import MultiMapping

from gateway.ai.worker import task_to_json
from gateway.alarms import AlarmNotFoundError, AlarmService, StatusChangedError, alarm_to_json
from gateway.config import TokenConfig
from gateway.domain.alarm import (
    PERSON_ACTIONS,
    SYSTEM_ACTOR_PREFIX,
    Action,
    Alarm,
    AlarmStatus,
    AlarmSupersededError,
    IllegalTransitionError,
    InvalidActorError,
)
from gateway.errors import GatewayError
from storage.audit import audit_failure
from storage.errors import TRANSIENT_DB_ERRORS

log = structlog.get_logger("gateway.api")

REQUEST_ID_HEADER: Final = "X-Request-Id"
REQUEST_ID_MAX_LENGTH: Final = 128
ACTOR_MAX_LENGTH: Final = 128
NOTE_MAX_LENGTH: Final = 2000
LIMIT_DEFAULT: Final = 50
LIMIT_MAX: Final = 500
FILTER_MAX_LENGTH: Final = 256
_ID_MAX: Final = 2**63 - 1  # bigint: a larger id would be a driver error, not a 400
_JSON: Final = "application/json"
# People's actions in a fixed order (the order the routes and the OpenAPI paths use).
PATH_ACTIONS: Final = tuple(a for a in Action if a in PERSON_ACTIONS)


class Role(IntEnum):
    """Each role may do everything the weaker ones may."""

    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3


class ApiError(GatewayError):
    """An HTTP error in the one error shape; ``details`` join ``error`` and ``message``."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})
        self.details = details

    def response(self) -> web.Response:
        body = {"error": self.code, "message": self.message, **self.details}
        return json_response(body, status=self.status, headers=self.headers)


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(400, "BAD_REQUEST", f"{param}: {message}", param=param)


def json_response(
    body: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    # msgspec writes datetimes as RFC 3339 and enums as their values.
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type=_JSON, headers=headers
    )


class ActionBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /alarms/{id}/{action}``: who acts, and why."""

    actor: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=ACTOR_MAX_LENGTH,
            pattern=r"\S",
            description="The person acting (not blank; `system:` is reserved for the gateway).",
        ),
    ]
    note: (
        Annotated[str, msgspec.Meta(max_length=NOTE_MAX_LENGTH, description="Free text.")] | None
    ) = None

    def __post_init__(self) -> None:
        if self.actor.startswith(SYSTEM_ACTOR_PREFIX):
            # msgspec reports it as a ValidationError naming the field: same 422 as the rest.
            raise ValueError(f"actor: the {SYSTEM_ACTOR_PREFIX!r} prefix is the gateway's own")


_BODY_DECODER: Final = msgspec.json.Decoder(ActionBody)


# --- errors -------------------------------------------------------------------------------

_HTTP_CODES: Final = {
    400: "BAD_REQUEST",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "PAYLOAD_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
}
# A database that cannot be reached is a temporary fault (503), not a bug (500).
_UNAVAILABLE: Final = TRANSIENT_DB_ERRORS


def _from_domain(exc: Exception) -> ApiError | None:
    """The HTTP face of an alarm error; None for anything that is not one."""
    if isinstance(exc, AlarmNotFoundError):
        return ApiError(404, exc.code, str(exc), alarm_id=exc.alarm_id)
    if isinstance(exc, AlarmSupersededError):
        return ApiError(400, exc.code, str(exc), superseded_by=exc.superseded_by)
    if isinstance(exc, IllegalTransitionError):
        return ApiError(
            400, exc.code, str(exc), current_status=exc.status, action=exc.action,
            allowed=list(exc.allowed),
        )  # fmt: skip
    if isinstance(exc, StatusChangedError):
        return ApiError(
            409, exc.code, str(exc), current_status=exc.current.status, actor=exc.actor,
            alarm=alarm_to_json(exc.current),
        )  # fmt: skip
    if isinstance(exc, InvalidActorError):
        return ApiError(422, exc.code, str(exc), actor=exc.actor, reason=exc.reason)
    return None


def error_response(exc: Exception, request: web.Request) -> web.Response:
    """Any exception as a response in the one error shape; unexpected ones are logged."""
    if isinstance(exc, ApiError):
        return exc.response()
    domain = _from_domain(exc)
    if domain is not None:
        return domain.response()
    if isinstance(exc, web.HTTPException):
        # The router's 404/405, aiohttp's 413: keep their status and headers (Allow).
        headers = {k: v for k, v in exc.headers.items() if k.lower() != "content-type"}
        code = _HTTP_CODES.get(exc.status, f"HTTP_{exc.status}")
        return ApiError(exc.status, code, exc.reason, headers=headers).response()
    table = audit_failure(exc)
    if table is not None:
        # A known fault with a known effect: no traceback, the daemon logged the row's error.
        log.error(
            "api_audit_failed", method=request.method, path=request.path, table=table,
            error=repr(exc),
        )  # fmt: skip
        return ApiError(
            500, "AUDIT_FAILED",
            "the change was rolled back: its audit row could not be written; see the gateway's log",
        ).response()  # fmt: skip
    if isinstance(exc, _UNAVAILABLE):
        log.warning(
            "api_database_unavailable", method=request.method, path=request.path, error=repr(exc)
        )
        return ApiError(503, "UNAVAILABLE", "the database is not reachable; retry").response()
    log.exception("api_error", method=request.method, path=request.path)
    return ApiError(500, "INTERNAL", "internal error; see the gateway's log").response()


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The one error shape for everything the API routes do not answer themselves."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc, request)
    except Exception as exc:  # the catch-all: logged inside error_response
        return error_response(exc, request)


# --- authentication -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Caller:
    name: str
    role: Role


@dataclass(frozen=True, slots=True)
class Call:
    """What an endpoint gets besides the request: who called, and the request id."""

    caller: Caller
    request_id: str


Endpoint = Callable[[web.Request, Call], Awaitable[web.StreamResponse]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _digest(secret: str) -> bytes:
    # Comparing fixed-length digests hides the configured tokens' lengths as well.
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


class BearerAuth:
    """``Authorization: Bearer <token>`` checked against the configured tokens."""

    def __init__(self, tokens: Sequence[TokenConfig]) -> None:
        self.replace(tokens)

    def replace(self, tokens: Sequence[TokenConfig]) -> None:
        """Swap the whole token set at once (SIGHUP): a request sees the old or the new."""
        self._tokens = [
            (_digest(t.token), Caller(name=t.name or f"token#{i}", role=Role[t.role.upper()]))
            for i, t in enumerate(tokens)
            if t.token
        ]

    def identify(self, headers: MultiMapping[str]) -> Caller:
        scheme, _, presented = headers.get("Authorization", "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            raise ApiError(
                401, "UNAUTHORIZED", "a bearer token is required",
                headers={"WWW-Authenticate": 'Bearer realm="gateway"'},
            )  # fmt: skip
        digest = _digest(presented)
        found: Caller | None = None
        for expected, caller in self._tokens:
            # No early exit: every token is compared whichever one matches.
            if hmac.compare_digest(digest, expected) and found is None:
                found = caller
        if found is None:
            raise ApiError(
                401, "UNAUTHORIZED", "unknown bearer token",
                headers={"WWW-Authenticate": 'Bearer realm="gateway", error="invalid_token"'},
            )  # fmt: skip
        return found

    def authorize(self, headers: MultiMapping[str], role: Role) -> Caller:
        caller = self.identify(headers)
        if caller.role < role:
            needed, held = role.name.lower(), caller.role.name.lower()
            raise ApiError(
                403, "FORBIDDEN", f"the {held} role may not do this; {needed} is needed",
                required_role=needed,
            )  # fmt: skip
        return caller

    def guard(self, role: Role, endpoint: Endpoint) -> Handler:
        """The endpoint behind authentication, ``role`` at least, and the error shape."""

        async def handler(request: web.Request) -> web.StreamResponse:
            request_id: str | None = None
            try:
                caller = self.authorize(request.headers, role)
                request_id = _request_id(request.headers)
                response = await endpoint(request, Call(caller=caller, request_id=request_id))
            except ApiError as exc:
                if exc.status in {401, 403}:
                    log.warning(
                        "api_access_refused", status=exc.status, method=request.method,
                        path=request.path, remote=request.remote,
                    )  # fmt: skip
                response = exc.response()
            except Exception as exc:  # the error shape, logged if unexpected
                response = error_response(exc, request)
            if request_id is not None:
                response.headers[REQUEST_ID_HEADER] = request_id
            return response

        return handler


def _request_id(headers: MultiMapping[str]) -> str:
    value = headers.get(REQUEST_ID_HEADER)
    if value is None:
        return str(uuid.uuid4())
    # It goes to logs and the audit table: short, printable, no spaces.
    if not 0 < len(value) <= REQUEST_ID_MAX_LENGTH or not all("!" <= c <= "~" for c in value):
        raise bad_request(
            REQUEST_ID_HEADER, f"1 to {REQUEST_ID_MAX_LENGTH} printable ASCII characters"
        )
    return value


# --- parameters -----------------------------------------------------------------------------


def positive_int(param: str, raw: str) -> int:
    if not raw.isascii() or not raw.isdigit():
        raise bad_request(param, f"expected a positive integer, got {raw[:40]!r}")
    value = int(raw)
    if not 0 < value <= _ID_MAX:
        raise bad_request(param, f"expected 1 to {_ID_MAX}, got {raw[:40]!r}")
    return value


def _alarm_id(request: web.Request) -> int:
    return positive_int("id", request.match_info["id"])


def single_param(query: MultiMapping[str], param: str) -> str | None:
    values = query.getall(param, [])
    if len(values) > 1:
        raise bad_request(param, "given more than once")
    return values[0] if values else None


def _filter(query: MultiMapping[str], param: str) -> str | None:
    value = single_param(query, param)
    if value is not None and not 0 < len(value) <= FILTER_MAX_LENGTH:
        raise bad_request(param, f"expected 1 to {FILTER_MAX_LENGTH} characters")
    return value


_BOOLEANS: Final = {"true": True, "1": True, "false": False, "0": False}
LIST_PARAMS: Final = frozenset({"status", "device", "rule", "open", "limit", "before"})


@dataclass(frozen=True, slots=True)
class ListQuery:
    statuses: list[str] | None
    device_id: str | None
    rule_key: str | None
    open_only: bool
    before_id: int | None
    limit: int


def parse_list_query(query: MultiMapping[str]) -> ListQuery:
    """``GET /alarms`` parameters; the first bad one is a 400 naming it."""
    unknown = sorted(set(query) - LIST_PARAMS)
    if unknown:
        raise bad_request(unknown[0], f"unknown parameter; known: {', '.join(sorted(LIST_PARAMS))}")
    statuses: list[str] | None = None
    if "status" in query:
        statuses = query.getall("status")
        known = [s.value for s in AlarmStatus]
        for status in statuses:
            if status not in known:
                raise bad_request("status", f"{status[:40]!r} is not one of {', '.join(known)}")
    open_raw = single_param(query, "open")
    if open_raw is not None and open_raw.lower() not in _BOOLEANS:
        raise bad_request("open", f"expected true or false, got {open_raw[:40]!r}")
    limit_raw = single_param(query, "limit")
    limit = LIMIT_DEFAULT if limit_raw is None else positive_int("limit", limit_raw)
    if limit > LIMIT_MAX:
        raise bad_request("limit", f"expected 1 to {LIMIT_MAX}, got {limit}")
    before_raw = single_param(query, "before")
    return ListQuery(
        statuses=statuses,
        device_id=_filter(query, "device"),
        rule_key=_filter(query, "rule"),
        open_only=False if open_raw is None else _BOOLEANS[open_raw.lower()],
        before_id=None if before_raw is None else positive_int("before", before_raw),
        limit=limit,
    )


def decode_action_body(raw: bytes) -> ActionBody:
    try:
        return _BODY_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # ValidationError is a DecodeError: both are a body that does not fit the schema.
        raise ApiError(
            422, "INVALID_BODY", "the request body does not fit", detail=str(exc)
        ) from exc


# --- endpoints ------------------------------------------------------------------------------


SUMMARY_FIELDS = (
    "status", "summary", "possible_cause", "inspection_suggestion", "risk_level", "confidence",
    "model_name", "prompt_version", "error_code", "attempt", "finished_at",
)  # fmt: skip


def summary_view(row: asyncpg.Record) -> dict[str, Any]:
    """The ``ai_summary`` of an alarm: the latest attempt's outcome, without payloads."""
    view = task_to_json(row, with_payloads=False)
    return {key: view.get(key) for key in SUMMARY_FIELDS}


class AlarmEndpoints:
    def __init__(self, service: AlarmService) -> None:
        self.service = service

    async def detail(self, alarm: Alarm) -> dict[str, Any]:
        """An alarm as ``GET /alarms/{id}`` and the actions answer it, with its latest AI
        summary attempt under ``ai_summary`` (null when there is none)."""
        body = alarm_to_json(alarm)
        latest = await self.service.latest_summary(alarm.id)
        body["ai_summary"] = None if latest is None else summary_view(latest)
        return body

    async def summaries(self, request: web.Request, call: Call) -> web.StreamResponse:
        """Every summary attempt; the request and raw response only for admins."""
        rows = await self.service.summaries(_alarm_id(request))
        admin = call.caller.role >= Role.ADMIN
        return json_response({"items": [task_to_json(r, with_payloads=admin) for r in rows]})

    async def list(self, request: web.Request, _call: Call) -> web.StreamResponse:
        q = parse_list_query(request.query)
        # One more than asked: a next page is promised only if it has something on it.
        found = await self.service.find(
            statuses=q.statuses, device_id=q.device_id, rule_key=q.rule_key,
            open_only=q.open_only, before_id=q.before_id, limit=q.limit + 1,
        )  # fmt: skip
        page = found[: q.limit]
        next_before = page[-1].id if len(found) > q.limit else None
        return json_response(
            {"items": [alarm_to_json(a) for a in page], "next_before": next_before}
        )

    async def get(self, request: web.Request, _call: Call) -> web.StreamResponse:
        alarm = await self.service.get(_alarm_id(request))
        return json_response(await self.detail(alarm))

    async def actions(self, request: web.Request, _call: Call) -> web.StreamResponse:
        alarm, allowed = await self.service.allowed(_alarm_id(request))
        body: dict[str, Any] = {"status": alarm.status, "actions": list(allowed)}
        if alarm.status is AlarmStatus.SUPERSEDED:
            body["actions"] = []
            body["superseded_by"] = alarm.superseded_by
        return json_response(body)

    async def chain(self, request: web.Request, _call: Call) -> web.StreamResponse:
        alarm_id = _alarm_id(request)
        items = await self.service.chain(alarm_id)
        body: dict[str, Any] = {"items": [alarm_to_json(a) for a in items], "hint": None}
        this = next(a for a in items if a.id == alarm_id)
        if this.status is AlarmStatus.SUPERSEDED:
            successor = "a newer alarm" if this.superseded_by is None else this.superseded_by
            body["hint"] = f"superseded by {successor}, cannot be handled on its own"
            body["superseded_by"] = this.superseded_by
        return json_response(body)

    async def audit(self, request: web.Request, _call: Call) -> web.StreamResponse:
        rows = await self.service.audit(_alarm_id(request))
        return json_response({"items": rows})

    def act(self, action: Action) -> Endpoint:
        async def endpoint(request: web.Request, call: Call) -> web.StreamResponse:
            alarm_id = _alarm_id(request)
            body = decode_action_body(await request.read())
            try:
                alarm = await self.service.act(
                    alarm_id, action, actor=body.actor, note=body.note,
                    request_id=call.request_id,
                )  # fmt: skip
            except Exception as exc:
                refused = _from_domain(exc)
                if refused is None:
                    raise
                log.info(
                    "alarm_action_refused", alarm_id=alarm_id, action=action.value,
                    actor=body.actor, token=call.caller.name, request_id=call.request_id,
                    code=refused.code,
                )  # fmt: skip
                raise refused from exc
            log.info(
                "alarm_action", alarm_id=alarm_id, action=action.value, actor=body.actor,
                token=call.caller.name, request_id=call.request_id, status=alarm.status.value,
            )  # fmt: skip
            return json_response(await self.detail(alarm))

        return endpoint


# The served /openapi.json: the API modules that mount routes set it (see add_command_api).
OPENAPI_DOCUMENT: web.AppKey[bytes] = web.AppKey("openapi_document")


def add_alarm_api(
    app: web.Application, *, service: AlarmService, tokens: Sequence[TokenConfig]
) -> BearerAuth:
    """Add the alarm routes and ``/openapi.json`` to ``app`` (before it starts).

    /health, /metrics and /openapi.json stay open; every alarm route needs a token.
    Returns the token check, whose ``replace`` a configuration reload calls.
    """
    # openapi reads this module's body struct and limits: imported here, not at the top.
    from gateway.openapi import openapi_document

    if error_middleware not in app.middlewares:
        app.middlewares.append(error_middleware)
    auth = BearerAuth(tokens)
    alarms = AlarmEndpoints(service)
    app[OPENAPI_DOCUMENT] = msgspec.json.encode(openapi_document())

    async def openapi(request: web.Request) -> web.Response:
        # Read at request time: add_command_api replaces it with the fuller document.
        return web.Response(body=request.app[OPENAPI_DOCUMENT], content_type=_JSON)

    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/alarms", auth.guard(Role.VIEWER, alarms.list))
    app.router.add_get("/alarms/{id}", auth.guard(Role.VIEWER, alarms.get))
    app.router.add_get("/alarms/{id}/actions", auth.guard(Role.VIEWER, alarms.actions))
    app.router.add_get("/alarms/{id}/chain", auth.guard(Role.VIEWER, alarms.chain))
    app.router.add_get("/alarms/{id}/audit", auth.guard(Role.VIEWER, alarms.audit))
    app.router.add_get("/alarms/{id}/summaries", auth.guard(Role.VIEWER, alarms.summaries))
    for action in PATH_ACTIONS:
        app.router.add_post(
            f"/alarms/{{id}}/{action.value}", auth.guard(Role.OPERATOR, alarms.act(action))
        )
    return auth
