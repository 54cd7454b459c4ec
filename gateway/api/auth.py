"""Bearer tokens with roles: one guard, the role each route needs declared with the route.

``Authorization: Bearer <token>`` is compared with the configured tokens as SHA-256 digests,
every one of them whichever matches (no early exit, no length leak). The token set is swapped
whole on SIGHUP (:meth:`BearerAuth.replace`). The header's value is never logged, nor put in
an error: a refusal says only which check failed, and is logged at info within a cap
(:func:`log_refusal`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

import structlog
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler

from gateway.api.errors import FORBIDDEN, REQUEST_ID_HEADER, UNAUTHORIZED, ApiError, bad_request
from gateway.config import TokenConfig
from gateway.support.log_limit import LogLimit

log = structlog.get_logger(__name__)

REQUEST_ID_MAX_LENGTH: Final = 128
# It goes to logs and the audit table: short, printable, no spaces.
REQUEST_ID_PATTERN: Final = r"^[!-~]+$"
_REQUEST_ID_RE: Final = re.compile(r"[!-~]{1,%d}" % REQUEST_ID_MAX_LENGTH, re.ASCII)  # noqa: UP031 - % keeps the {m,n} braces plain
STATE_CALLER: Final = "caller"
STATE_REQUEST_ID: Final = "request_id"
BEARER_SCHEME: Final = "bearerAuth"


class Role(IntEnum):
    """Each role may do everything the weaker ones may."""

    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Caller:
    name: str
    role: Role
    # Which configured token (a digest of it): what lets a reload that removes or rotates a
    # token end the streams it opened, even under the same name. Never in a repr (a log).
    key: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class Call:
    """What an endpoint gets besides its parameters: who called, and the request id."""

    caller: Caller
    request_id: str


# What a handler declares to get the caller and the request id (the dependency `call`).
CallDep = NamedDependency[Call]


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
            # The configuration requires a unique name; the fallback serves hand-built configs.
            (
                digest,
                Caller(name=t.name or f"token#{i}", role=Role[t.role.upper()], key=digest),
            )
            for i, t in enumerate(tokens)
            if t.token
            for digest in (_digest(t.token),)
        ]
        self._callers = frozenset(caller for _, caller in self._tokens)

    def holds(self, caller: Caller) -> bool:
        """Whether ``caller`` is still configured as it was (name, role and token): what a
        stream opened before a reload checks."""
        return caller in self._callers

    def named(self, name: str, role: Role) -> Caller | None:
        """The configured token of this name and role (what a stream ticket names), if any."""
        for caller in self._callers:
            if caller.name == name and caller.role == role:
                return caller
        return None

    def identify(self, authorization: str | None) -> Caller:
        scheme, _, presented = (authorization or "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            raise ApiError(
                UNAUTHORIZED,
                "a bearer token is required",
                headers={"WWW-Authenticate": 'Bearer realm="gateway"'},
            )
        digest = _digest(presented)
        found: Caller | None = None
        for expected, caller in self._tokens:
            # No early exit: every token is compared whichever one matches.
            if hmac.compare_digest(digest, expected) and found is None:
                found = caller
        if found is None:
            raise ApiError(
                UNAUTHORIZED,
                "unknown bearer token",
                headers={"WWW-Authenticate": 'Bearer realm="gateway", error="invalid_token"'},
            )
        return found

    def authorize(self, authorization: str | None, role: Role) -> Caller:
        caller = self.identify(authorization)
        if caller.role < role:
            raise ApiError(
                FORBIDDEN,
                f"the {caller.role.label} role may not do this; {role.label} is needed",
                required_role=role.label,
            )
        return caller


# A refusal is what anyone reaching the port can cause, as often as they like: logged at info
# (the request was wrong, not the gateway), at most REFUSAL_LOG_LINES lines in
# REFUSAL_LOG_INTERVAL_S seconds, the next line written counting those left out.
REFUSAL_LOG_LINES: Final = 10
REFUSAL_LOG_INTERVAL_S: Final = 60.0
_refusals = LogLimit(REFUSAL_LOG_LINES, REFUSAL_LOG_INTERVAL_S)


def log_refusal(event: str, **fields: Any) -> None:
    """Log a refused request (no token, an unknown one, a weak role, a bad stream ticket)
    within the cap; ``suppressed`` counts the refusals not logged since the last line."""
    suppressed = _refusals.take()
    if suppressed is not None:
        log.info(event, suppressed=suppressed, **fields)


def _state(connection: ASGIConnection[Any, Any, Any, Any]) -> dict[str, Any]:
    state: dict[str, Any] = connection.scope.setdefault("state", {})
    return state


async def require_role(
    connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler
) -> None:
    """The guard of every route declared with a role (``opt["role"]``): the token, then the
    request id (recorded with changes, echoed in the answer, generated when absent).

    A coroutine although it awaits nothing: litestar hands a plain function to a worker
    thread on every request (a third of the time of a command request went to such hops)."""
    role = handler.opt["role"]
    auth: BearerAuth = connection.app.state["auth"]
    try:
        caller = auth.authorize(connection.headers.get("authorization"), role)
    except ApiError as exc:
        client = connection.client
        log_refusal(
            "api_access_refused",
            status=exc.kind.status,
            method=connection.scope.get("method"),
            path=connection.url.path[:200],
            remote=None if client is None else client.host,
        )
        raise
    given = connection.headers.get(REQUEST_ID_HEADER)
    if given is not None and _REQUEST_ID_RE.fullmatch(given) is None:
        raise bad_request(
            REQUEST_ID_HEADER, f"1 to {REQUEST_ID_MAX_LENGTH} printable ASCII characters"
        )
    state = _state(connection)
    state[STATE_CALLER] = caller
    state[STATE_REQUEST_ID] = given or str(uuid.uuid4())


def call_of(request: ASGIConnection[Any, Any, Any, Any]) -> Call:
    """The dependency ``call``: who called (set by the guard), and the request id."""
    state = _state(request)
    return Call(caller=state[STATE_CALLER], request_id=state[STATE_REQUEST_ID])


def actor_of(call: Call) -> str:
    """Whatever the API records (alarm actions, commands, cancels, unbinds) is attributed to
    the token that asked: its configured name, never what a body says."""
    return call.caller.name
