"""The operator HTTP API for downlink commands (SPEC §7, §9), behind the alarm API's tokens.

``POST /devices/{id}/commands?wait=<s>`` may wait for the outcome. Nothing notifies terminal
states (``command_due`` fires only for PENDING rows), so the wait polls the one row by its
primary key: 50 ms apart at first, backing off to 0.5 s, each read on a pooled connection taken
for that read alone. A waiting request holds no connection between reads, so waiters cannot
starve the pool; the daemon's stop event ends every wait at once, so shutdown never waits for
them. A read that fails (database unreachable) does not end the wait: the command exists
already, and at the deadline the caller gets it as last read rather than a 503 without its id.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Final

import asyncpg
import msgspec
import structlog
from aiohttp import web
from multidict import MultiMapping

from gateway.api import (
    LIMIT_DEFAULT,
    LIMIT_MAX,
    OPENAPI_DOCUMENT,
    ApiError,
    BearerAuth,
    Call,
    Role,
    bad_request,
    json_response,
    positive_int,  # the alarm API's id parsing: one grammar for every id in a path
    single_param,
)
from gateway.commands import (
    CommandClosedError,
    CommandNotFoundError,
    Created,
    DeviceUnboundError,
    cancel,
    command_to_json,
    create_command,
    unbind,
)
from gateway.domain.command import TERMINAL_STATUSES, CommandStatus, Delivery
from gateway.loops import sleep_unless_stopped
from gateway.metrics import Metrics
from protocol import is_valid_device_id
from storage import commands as repo
from storage.errors import TRANSIENT_DB_ERRORS

log = structlog.get_logger("gateway.command_api")

NAME_MAX_LENGTH: Final = 128  # the command table's CHECK
IDEMPOTENCY_KEY_MAX_LENGTH: Final = 256
# Devices are small: a downlink's params beyond this are a mistake, not a command.
PARAMS_MAX_BYTES: Final = 65_536
WAIT_MAX_S: Final = 60.0
API_ACTOR_PREFIX: Final = "api:"
OPENAPI_PATH: Final = "/openapi.json"
POLL_FIRST_S: Final = 0.05
POLL_MAX_S: Final = 0.5
POLL_GROWTH: Final = 1.25
# One poll's read may not stretch the wait by more than this (a pool waiting to connect).
READ_TIMEOUT_S: Final = 2.0
_UNREADABLE: Final = TRANSIENT_DB_ERRORS
CREATE_PARAMS: Final = frozenset({"wait"})
LIST_PARAMS: Final = frozenset({"limit", "before"})
_SECONDS_RE: Final = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?", re.ASCII)


def _has_nul(params: Mapping[str, Any]) -> bool:
    """Whether any key or string in ``params`` holds U+0000 (jsonb refuses it).

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


class CommandBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /devices/{id}/commands``: what to send, and how hard to try."""

    name: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=NAME_MAX_LENGTH,
            pattern=r"\S",
            description="The command the device runs (not blank).",
        ),
    ]
    params: dict[str, Any] = msgspec.field(default_factory=dict)
    delivery: Delivery = Delivery.REALTIME
    idempotency_key: (
        Annotated[
            str,
            msgspec.Meta(
                min_length=1,
                max_length=IDEMPOTENCY_KEY_MAX_LENGTH,
                pattern=r"\S",
                description="The same key again on the same device returns the first command.",
            ),
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        # Raised here, msgspec reports these as ValidationErrors: the same 422 as the rest.
        for field, value in (("name", self.name), ("idempotency_key", self.idempotency_key)):
            if value is not None and "\x00" in value:
                raise ValueError(f"{field}: U+0000 is not allowed")
        if _has_nul(self.params):
            raise ValueError("params: U+0000 is not allowed in keys or strings")
        size = len(msgspec.json.encode(self.params))
        if size > PARAMS_MAX_BYTES:
            raise ValueError(f"params: {size} bytes as JSON, at most {PARAMS_MAX_BYTES}")


_BODY_DECODER: Final = msgspec.json.Decoder(CommandBody)


def decode_command_body(raw: bytes) -> CommandBody:
    try:
        return _BODY_DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        # ValidationError is a DecodeError; RecursionError is nesting deeper than msgspec goes.
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ApiError(422, "INVALID_BODY", "the request body does not fit", detail=detail) from exc


class CommandService:
    """Commands for the API: each call one transaction on a pooled connection."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        node_id: str,
        expire_after_s: float,
        *,
        stop: asyncio.Event | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.pool = pool
        self.node_id = node_id
        self.expire_after_s = expire_after_s
        # Set by the daemon on shutdown: every wait returns at once with what it has.
        self.stop = stop or asyncio.Event()
        self.metrics = metrics

    async def create(
        self,
        *,
        device_id: str,
        name: str,
        params: dict[str, Any],
        delivery: Delivery,
        idempotency_key: str | None,
        actor: str,
    ) -> Created:
        async with self.pool.acquire() as conn, conn.transaction():
            return await create_command(
                conn, device_id=device_id, name=name, params=params, delivery=delivery,
                idempotency_key=idempotency_key, created_by=actor, node_id=self.node_id,
                expire_after_s=self.expire_after_s,
            )  # fmt: skip

    async def get(self, command_id: int) -> tuple[asyncpg.Record, list[asyncpg.Record]]:
        """The command and every receipt for it, read in one snapshot."""
        async with (
            self.pool.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            row = await repo.get(conn, command_id)
            if row is None:
                raise CommandNotFoundError(command_id)
            return row, await repo.receipts_of(conn, command_id)

    async def cancel(self, command_id: int, *, actor: str) -> asyncpg.Record:
        async with self.pool.acquire() as conn, conn.transaction():
            row = await cancel(conn, command_id, actor=actor, node_id=self.node_id)
        self._count([row])
        return row

    async def unbind(self, device_id: str, *, actor: str) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn, conn.transaction():
            cancelled = await unbind(conn, device_id, actor=actor, node_id=self.node_id)
        self._count(cancelled)
        return cancelled

    def _count(self, changed: Sequence[asyncpg.Record]) -> None:
        """Count committed status changes (rows carrying the ``previous_status`` they left)."""
        if self.metrics is not None:
            for row in changed:
                self.metrics.count_command(row["previous_status"], row["status"])

    async def wait_terminal(self, command_id: int, timeout_s: float) -> asyncpg.Record:
        """The command once terminal, or as it is when ``timeout_s`` ends (or stop is set)."""
        row, _ = await self.get(command_id)
        return await self.wait_for(row, timeout_s)

    async def wait_for(self, row: asyncpg.Record, timeout_s: float) -> asyncpg.Record:
        """Like :meth:`wait_terminal`, starting from ``row`` as already read."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        interval = POLL_FIRST_S
        failures = 0
        while CommandStatus(row["status"]) not in TERMINAL_STATUSES:
            remaining = deadline - loop.time()
            if remaining <= 0 or self.stop.is_set():
                break
            await sleep_unless_stopped(self.stop, min(interval, remaining))
            interval = min(interval * POLL_GROWTH, POLL_MAX_S)
            try:
                async with asyncio.timeout(READ_TIMEOUT_S), self.pool.acquire() as conn:
                    fresh = await repo.get(conn, row["id"])
            except _UNREADABLE as exc:
                failures += 1
                if failures == 1:
                    log.warning("command_wait_read_failed", command_id=row["id"], error=repr(exc))
                continue
            if fresh is None:  # commands are never deleted; a restored backup could do it
                raise CommandNotFoundError(row["id"])
            row = fresh
        return row

    async def list(
        self, device_id: str, *, before_id: int | None, limit: int
    ) -> Sequence[asyncpg.Record]:
        """The device's commands, newest first, with ids below ``before_id``."""
        async with self.pool.acquire() as conn:
            return await repo.list_for_device(conn, device_id, before_id=before_id, limit=limit)


# --- parameters -----------------------------------------------------------------------------


def _device_id(request: web.Request) -> str:
    device_id = request.match_info["id"]
    if not is_valid_device_id(device_id):
        raise bad_request("id", f"not a device id: {device_id[:80]!r} (1 to 64 of A-Za-z0-9_.:-)")
    return device_id


def _command_id(request: web.Request) -> int:
    return positive_int("id", request.match_info["id"])


def _no_unknown(query: MultiMapping[str], known: frozenset[str]) -> None:
    unknown = sorted(set(query) - known)
    if unknown:
        raise bad_request(unknown[0], f"unknown parameter; known: {', '.join(sorted(known))}")


def parse_wait(query: MultiMapping[str]) -> float | None:
    """``wait``: seconds to wait for the outcome, 0 to ``WAIT_MAX_S``; None when absent."""
    _no_unknown(query, CREATE_PARAMS)
    raw = single_param(query, "wait")
    if raw is None:
        return None
    # Plain decimals only: float() would also take "inf", "nan", "1e1", "1_0" and spaces.
    seconds = None if _SECONDS_RE.fullmatch(raw) is None else float(raw)
    if seconds is None or seconds > WAIT_MAX_S:
        raise bad_request("wait", f"expected seconds from 0 to {WAIT_MAX_S:g}, got {raw[:40]!r}")
    return seconds


def parse_page(query: MultiMapping[str]) -> tuple[int | None, int]:
    """``before`` (keyset cursor) and ``limit``, as ``GET /alarms`` takes them."""
    _no_unknown(query, LIST_PARAMS)
    limit_raw = single_param(query, "limit")
    limit = LIMIT_DEFAULT if limit_raw is None else positive_int("limit", limit_raw)
    if limit > LIMIT_MAX:
        raise bad_request("limit", f"expected 1 to {LIMIT_MAX}, got {limit}")
    before_raw = single_param(query, "before")
    before = None if before_raw is None else positive_int("before", before_raw)
    return before, limit


def _refused(exc: CommandNotFoundError | DeviceUnboundError | CommandClosedError) -> ApiError:
    """The HTTP face of a command error."""
    if isinstance(exc, CommandNotFoundError):
        return ApiError(404, exc.code, str(exc), command_id=exc.command_id)
    if isinstance(exc, DeviceUnboundError):
        return ApiError(409, exc.code, str(exc), device_id=exc.device_id)
    return ApiError(400, exc.code, str(exc), command_id=exc.command_id, current_status=exc.status)


def _receipt_to_json(row: asyncpg.Record) -> dict[str, Any]:
    body: dict[str, Any] = msgspec.to_builtins(dict(row.items()))
    return body


def actor_of(call: Call) -> str:
    """Commands are attributed to the token that asked: ``api:<token name>``."""
    return f"{API_ACTOR_PREFIX}{call.caller.name}"


# --- endpoints ------------------------------------------------------------------------------


class CommandEndpoints:
    def __init__(self, service: CommandService) -> None:
        self.service = service

    async def create(self, request: web.Request, call: Call) -> web.StreamResponse:
        device_id = _device_id(request)
        wait_s = parse_wait(request.query)
        body = decode_command_body(await request.read())
        actor = actor_of(call)
        try:
            created = await self.service.create(
                device_id=device_id, name=body.name, params=body.params, delivery=body.delivery,
                idempotency_key=body.idempotency_key, actor=actor,
            )  # fmt: skip
        except DeviceUnboundError as exc:
            log.info(
                "command_create_refused", device_id=device_id, token=call.caller.name,
                request_id=call.request_id, code=exc.code,
            )  # fmt: skip
            raise _refused(exc) from exc
        row = created.command
        log.info(
            "command_created" if created.created else "command_create_repeated",
            command_id=row["id"], device_id=device_id, name=body.name,
            delivery=body.delivery.value, token=call.caller.name, request_id=call.request_id,
            wait_s=wait_s,
        )  # fmt: skip
        if wait_s is not None:
            row = await self.service.wait_for(row, wait_s)
        return json_response(
            {"command": command_to_json(row), "created": created.created},
            status=201 if created.created else 200,
        )

    async def get(self, request: web.Request, _call: Call) -> web.StreamResponse:
        command_id = _command_id(request)
        try:
            row, receipts = await self.service.get(command_id)
        except CommandNotFoundError as exc:
            raise _refused(exc) from exc
        return json_response(
            {"command": command_to_json(row), "receipts": [_receipt_to_json(r) for r in receipts]}
        )

    async def list(self, request: web.Request, _call: Call) -> web.StreamResponse:
        device_id = _device_id(request)
        before, limit = parse_page(request.query)
        # One more than asked: a next page is promised only if it has something on it.
        found = await self.service.list(device_id, before_id=before, limit=limit + 1)
        page = found[:limit]
        next_before = page[-1]["id"] if len(found) > limit else None
        return json_response(
            {"items": [command_to_json(r) for r in page], "next_before": next_before}
        )

    async def cancel(self, request: web.Request, call: Call) -> web.StreamResponse:
        command_id = _command_id(request)
        try:
            row = await self.service.cancel(command_id, actor=actor_of(call))
        except (CommandNotFoundError, CommandClosedError) as exc:
            refused = _refused(exc)
            log.info(
                "command_cancel_refused", command_id=command_id, token=call.caller.name,
                request_id=call.request_id, code=refused.code,
            )  # fmt: skip
            raise refused from exc
        log.info(
            "command_cancelled", command_id=command_id, device_id=row["device_id"],
            token=call.caller.name, request_id=call.request_id,
        )  # fmt: skip
        return json_response(command_to_json(row))

    async def unbind(self, request: web.Request, call: Call) -> web.StreamResponse:
        device_id = _device_id(request)
        cancelled = await self.service.unbind(device_id, actor=actor_of(call))
        ids = sorted(r["id"] for r in cancelled)
        log.info(
            "device_unbound", device_id=device_id, cancelled=ids, token=call.caller.name,
            request_id=call.request_id,
        )  # fmt: skip
        return json_response({"device_id": device_id, "cancelled": ids})


def add_command_api(app: web.Application, *, service: CommandService, auth: BearerAuth) -> None:
    """Add the command routes to ``app`` (before it starts), behind ``auth``.

    Call it after :func:`gateway.api.add_alarm_api`, with the ``auth`` that returned: one token
    set (and one reload) for both APIs, and its error middleware answers for these routes too.
    """
    if OPENAPI_DOCUMENT not in app:
        raise RuntimeError("add_alarm_api(app, ...) must come first: it sets up /openapi.json")
    # openapi reads this module's body struct and limits: imported here, not at the top.
    from gateway.openapi import openapi_document

    app[OPENAPI_DOCUMENT] = msgspec.json.encode(openapi_document(commands=True))
    endpoints = CommandEndpoints(service)
    app.router.add_post("/devices/{id}/commands", auth.guard(Role.OPERATOR, endpoints.create))
    app.router.add_get("/devices/{id}/commands", auth.guard(Role.VIEWER, endpoints.list))
    app.router.add_post("/devices/{id}/unbind", auth.guard(Role.OPERATOR, endpoints.unbind))
    app.router.add_get("/commands/{id}", auth.guard(Role.VIEWER, endpoints.get))
    app.router.add_post("/commands/{id}/cancel", auth.guard(Role.OPERATOR, endpoints.cancel))
