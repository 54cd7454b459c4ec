"""Declaring a route once, and checking its inputs at the boundary.

:func:`route` is the only way the API declares an operation: its path, the role it needs, the
errors it can answer. From that one declaration come the guard, the OpenAPI operation (security
with the role, one response per status listing its error codes) and what the exception handler
holds it to (:func:`gateway.api.errors.handle_exception` logs an answer a route did not declare).

:func:`check_inputs` runs before every handler, after the guard: unknown or repeated query
parameters, integers that are not plain digits (``1e3``, ``²``, 5,000 digits), numbers that are
not JSON numbers (``nan``, ``1_0``), strings that do not match their pattern (with ``$`` read as
the end of the string, as the document's readers read it), the text ``null`` for an optional
parameter that is not a string (``?until=null``: absent is how one says none), and a body that
does not decode into the route's Struct (malformed, too deep, out of bounds) are answered here,
400 or 422, before any of it reaches a handler, let alone the database.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
from litestar import Request
from litestar.datastructures import ResponseHeader
from litestar.enums import ParamType
from litestar.handlers import HTTPRouteHandler
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import ParameterKwarg

from gateway.api.auth import BEARER_SCHEME, Role, require_role
from gateway.api.errors import (
    AUDIT_FAILED,
    BAD_REQUEST,
    FORBIDDEN,
    INTERNAL,
    INVALID_BODY,
    PAYLOAD_TOO_LARGE,
    REQUEST_ID_HEADER,
    UNAUTHORIZED,
    UNAVAILABLE,
    ErrorBody,
    ErrorKind,
    bad_request,
    by_status,
    invalid_body,
)
from gateway.api.schemas import ID_DIGITS_MAX

_DIGITS: Final = re.compile(r"[0-9]{1,%d}" % ID_DIGITS_MAX, re.ASCII)  # noqa: UP031 - % keeps the {m,n} braces plain
_JSON_NUMBER: Final = re.compile(
    r"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,40})?(?:[eE][+-]?[0-9]{1,3})?"
)
_NOT_QUERY: Final = frozenset({"data", "request", "state", "headers", "query", "scope", "body"})


def route(
    method: Literal["GET", "POST", "PUT", "DELETE"],
    path: str,
    *,
    summary: str,
    operation_id: str,
    tag: str,
    role: Role | None,
    errors: Iterable[ErrorKind] = (),
    writes: bool = False,
    body: bool = False,
    description: str | None = None,
    status_code: int = 200,
    also: Mapping[int, ResponseSpec] | None = None,
    media_type: str = "application/json",
) -> Callable[[Callable[..., Any]], HTTPRouteHandler]:
    """The decorator of every API operation: everything the route promises, declared once."""
    # Every route's query is checked (check_inputs): even /health answers 400 to `?x=1`.
    kinds = {*errors, BAD_REQUEST}
    if role is not None:
        kinds |= {UNAUTHORIZED, INTERNAL, UNAVAILABLE}
        if role > Role.VIEWER:
            kinds.add(FORBIDDEN)
    if writes:
        kinds.add(AUDIT_FAILED)
    if body:
        kinds |= {INVALID_BODY, PAYLOAD_TOO_LARGE}
    responses: dict[int, ResponseSpec] = {
        status: ResponseSpec(
            data_container=ErrorBody,
            generate_examples=False,
            description="; ".join(f"`{k.code}`: {k.doc}" for k in group),
        )
        for status, group in by_status(kinds).items()
    }
    responses.update(also or {})
    text = description or ""
    if role is not None:
        text = (
            f"{text}\n\nNeeds a bearer token of the `{role.label}` role or a stronger one.".strip()
        )
    headers = None
    if role is not None:
        headers = [
            ResponseHeader(
                name=REQUEST_ID_HEADER,
                documentation_only=True,
                description="The request's id (given or generated).",
            )
        ]
    return HTTPRouteHandler(
        path,
        http_method=method,
        summary=summary,
        description=text or None,
        operation_id=operation_id,
        tags=[tag],
        status_code=status_code,
        media_type=media_type,
        guards=[require_role] if role is not None else None,
        security=[{BEARER_SCHEME: [role.label]}] if role is not None else None,
        responses=responses,
        response_headers=headers,
        opt={"role": role, "errors": frozenset(kinds)},
    )


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Param:
    name: str  # as the caller spells it
    many: bool
    kind: type | None  # int or float: a stricter grammar than msgspec's; None otherwise
    pattern: re.Pattern[str] | None
    null_is_none: bool  # msgspec would read the text `null` as None: refused
    required: bool = False  # no default: absent is a 400 here (not the framework's answer)


def _reads_null_as_none(annotation: Any) -> bool:
    """Whether Litestar's parsing (msgspec's lax conversion) turns the text ``null`` (in any
    case) into None: for every optional type but ``str``, which keeps it as text."""
    try:
        return msgspec.convert("null", annotation, strict=False) is None
    except (msgspec.ValidationError, TypeError):
        return False


@dataclass(frozen=True, slots=True)
class _Inputs:
    query: Mapping[str, _Param]
    path: Mapping[str, _Param]
    body: msgspec.json.Decoder[Any] | None


@functools.cache
def _strict(pattern: str) -> re.Pattern[str]:
    """``pattern`` with a closing ``$`` meaning the end of the string (as in ECMA 262)."""
    return re.compile(pattern.removesuffix("$") + r"\Z" if pattern.endswith("$") else pattern)


@functools.cache
def _decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


def _param(name: str, field: Any) -> _Param:
    definition = field.kwarg_definition
    pattern = getattr(definition, "pattern", None)
    inner = field.inner_types[0].annotation if field.is_non_string_sequence else field.annotation
    if field.is_optional and not field.is_non_string_sequence:
        inner = next(
            (t.annotation for t in field.inner_types if t.annotation is not type(None)), inner
        )
    kind = inner if inner in (int, float) else None
    return _Param(
        name=name,
        many=field.is_non_string_sequence,
        kind=kind,
        pattern=_strict(pattern) if pattern else None,
        null_is_none=field.is_optional and _reads_null_as_none(field.annotation),
        required=not field.is_optional and not field.has_default,
    )


def _inputs(request: Request[Any, Any, Any]) -> _Inputs:
    handler = request.route_handler
    cached = handler.opt.get("_inputs")
    if isinstance(cached, _Inputs):
        return cached
    dependencies = set(handler.resolve_dependencies())
    path_names = set(request.path_params)
    query: dict[str, _Param] = {}
    path: dict[str, _Param] = {}
    body = None
    for name, field in handler.parsed_fn_signature.parameters.items():
        definition = field.kwarg_definition
        if name == "data":
            body = _decoder(field.annotation)
        elif name in path_names:
            path[name] = _param(name, field)
        elif (
            name in _NOT_QUERY
            or name in dependencies
            or (isinstance(definition, ParameterKwarg) and (definition.header or definition.cookie))
            or getattr(definition, "param_type", None) in (ParamType.HEADER, ParamType.COOKIE)
        ):
            continue
        else:
            alias = definition.query if isinstance(definition, ParameterKwarg) else None
            query[alias or name] = _param(alias or name, field)
    inputs = _Inputs(query=query, path=path, body=body)
    handler.opt["_inputs"] = inputs
    return inputs


def _check(param: _Param, raw: str) -> None:
    shown = repr(raw[:40])
    if param.null_is_none and raw.isascii() and raw.lower() == "null":
        # Read as None, it would be "no filter": a value the document does not have.
        raise bad_request(param.name, f"{shown} is not a value; leave the parameter out for none")
    if param.kind is int and _DIGITS.fullmatch(raw) is None:
        raise bad_request(param.name, f"expected a positive integer, got {shown}")
    if param.kind is float and _JSON_NUMBER.fullmatch(raw) is None:
        raise bad_request(param.name, f"expected a number, got {shown}")
    if param.pattern is not None and param.pattern.search(raw) is None:
        raise bad_request(param.name, f"{shown} does not match {param.pattern.pattern}")


async def check_inputs(request: Request[Any, Any, Any]) -> None:
    """The boundary: every query and path parameter and the body, before the handler."""
    inputs = _inputs(request)
    query = request.query_params
    for name in sorted(set(query.keys())):
        param = inputs.query.get(name)
        if param is None:
            known = ", ".join(sorted(inputs.query)) or "none"
            raise bad_request(name, f"unknown parameter; known: {known}")
        values = query.getall(name)
        if len(values) > 1 and not param.many:
            raise bad_request(name, "given more than once")
        for value in values:
            _check(param, value)
    for name, param in inputs.query.items():
        if param.required and name not in query:
            raise bad_request(name, "required")
    for name, param in inputs.path.items():
        _check(param, str(request.path_params[name]))
    if inputs.body is not None:
        raw = await request.body()
        try:
            inputs.body.decode(raw)
        except RecursionError:
            raise invalid_body("nested too deeply") from None
        except msgspec.DecodeError as exc:  # ValidationError is one too
            raise invalid_body(str(exc)) from None
