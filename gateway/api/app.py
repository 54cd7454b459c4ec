"""The operator API as one Litestar app: routes, guard, boundary, errors, generated document.

``GET /openapi.json`` is the OpenAPI 3.1 document Litestar generates from the routes and the
Structs; ``GET /docs`` is Swagger UI for it, served from the ``swagger-ui-bundle-v2`` package's
files (no CDN: the page works on a site with no internet).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import msgspec
from litestar import Litestar, Request, Response, Router
from litestar.datastructures import MutableScopeHeaders, State
from litestar.di import Provide
from litestar.handlers import BaseRouteHandler
from litestar.openapi.config import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.openapi.spec import (
    Components,
    OpenAPI,
    Parameter,
    Reference,
    Schema,
    SecurityScheme,
    Tag,
)
from litestar.openapi.spec.enums import OpenAPIType
from litestar.params import HeaderParameter
from litestar.routes import HTTPRoute
from litestar.static_files import create_static_files_router
from litestar.types import BeforeMessageSendHookHandler, Message, Scope
from swagger_ui_bundle import swagger_ui_path

from gateway.api import (
    alarms,
    campaigns,
    commands,
    dead_letters,
    devices,
    figures,
    health,
    notify,
    rules,
    session,
    stream,
)
from gateway.api.auth import (
    BEARER_SCHEME,
    REQUEST_ID_MAX_LENGTH,
    REQUEST_ID_PATTERN,
    STATE_REQUEST_ID,
    BearerAuth,
    CallDep,
    call_of,
)
from gateway.api.console_route import console_routes
from gateway.api.errors import REQUEST_ID_HEADER, handle_exception
from gateway.api.health import HealthCheck
from gateway.api.routes import check_inputs, route
from gateway.api.schemas import (
    ACTOR_MAX_LENGTH,
    DEPRECATED_PROPERTIES,
    DESK_BODIES,
    IDEMPOTENCY_KEY_MAX_LENGTH,
    JSON_VALUE,
    JSON_VALUE_SCHEMA,
    NAME_MAX_LENGTH,
    NOTE_MAX_LENGTH,
    ActionBody,
    CommandBody,
    DeviceCommandBody,
    complete_desk,
)
from gateway.api.server import STATE_NO_HEAD
from gateway.api.services import STATE_SERVICES, Services
from gateway.support.metrics import Metrics
from gateway.support.version import gateway_version

OPENAPI_PATH: Final = "/openapi.json"
DOCS_PATH: Final = "/docs"
DOCS_ASSETS: Final = "/docs/assets"
# aiohttp's default before: a body beyond this is a 413, whatever the route.
MAX_BODY_BYTES: Final = 1024 * 1024
TITLE: Final = "MQTT alarm & command gateway: operator API"
# The paths whose GET answer never ends (the live stream): HEAD is not answered there.
NO_HEAD: Final = frozenset({"/stream"})


@route(
    "GET",
    OPENAPI_PATH,
    operation_id="openapi",
    tag=health.TAG,
    role=None,
    summary="This document (OpenAPI 3.1), generated from the routes and their types",
    also={
        200: ResponseSpec(
            data_container=dict[str, Any],
            generate_examples=False,
            description="The OpenAPI document.",
        )
    },
)
async def openapi_document(request: Request[Any, Any, Any]) -> Response[bytes]:
    state = request.app.state
    if "openapi_json" not in state:
        state["openapi_json"] = msgspec.json.encode(request.app.openapi_schema.to_schema())
    encoded: bytes = state["openapi_json"]
    return Response(encoded, media_type="application/json")


async def echo_request_id(message: Message, scope: Scope) -> None:
    """Every answer of a guarded route carries its request id (given or generated). A
    coroutine, as `require_role` is: litestar would run a plain function in a worker thread,
    for every message of every answer."""
    if message["type"] == "http.response.start":
        request_id = scope.get("state", {}).get(STATE_REQUEST_ID)
        if isinstance(request_id, str):
            MutableScopeHeaders.from_message(message)[REQUEST_ID_HEADER] = request_id


def _allow_every_method(allow: Mapping[BaseRouteHandler, str]) -> BeforeMessageSendHookHandler:
    """OPTIONS names every method its path serves. Litestar's OPTIONS handler lists the methods
    of the path's first handler only (it keeps the route it was made for, which a later handler
    of the same path replaces): `OPTIONS /silences` said `OPTIONS, POST`, not GET. ``allow``
    holds each path's methods, by its OPTIONS handler, once the app is built. An `Allow` with
    GET (an OPTIONS' or a 405's) names HEAD too, which the server answers as GET
    (:func:`gateway.api.server.head_as_get`), except on the paths of ``NO_HEAD``."""

    async def allow_every_method(message: Message, scope: Scope) -> None:
        if message["type"] != "http.response.start":
            return
        headers = MutableScopeHeaders.from_message(message)
        if scope.get("method") == "OPTIONS":
            methods = allow.get(scope.get("route_handler"))
            if methods is not None:
                headers["Allow"] = methods
        given = headers.get("Allow")
        if given is not None and scope.get("path") not in NO_HEAD:
            listed = {m.strip() for m in given.split(",")}
            if "GET" in listed and "HEAD" not in listed:
                headers["Allow"] = ", ".join(sorted(listed | {"HEAD"}))

    return allow_every_method


def _openapi_config() -> OpenAPIConfig:
    return OpenAPIConfig(
        title=TITLE,
        version=gateway_version(),
        description=(
            "Bearer tokens from the configuration carry a role: `viewer` may read, `operator` "
            "may also act on alarms and send commands, `admin` may do everything (and sees AI "
            "payloads). Each operation's `security` names the role it needs. Every error has one "
            f"shape (`ErrorBody`). Actors are at most {ACTOR_MAX_LENGTH} characters, notes at "
            f"most {NOTE_MAX_LENGTH}; command names at most {NAME_MAX_LENGTH}, idempotency keys "
            f"at most {IDEMPOTENCY_KEY_MAX_LENGTH}; bodies at most {MAX_BODY_BYTES} bytes. "
            "Every path also answers `OPTIONS`, without a token: 204, with `Allow` listing the "
            "path's methods (OPTIONS is not listed as an operation). Every path that answers "
            "`GET` answers `HEAD` as GET without the body (not listed either), but `/stream`."
        ),
        path=DOCS_PATH,
        render_plugins=[
            SwaggerRenderPlugin(
                path="/",
                js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                standalone_preset_js_url=f"{DOCS_ASSETS}/swagger-ui-standalone-preset.js",
                favicon=f"<link rel='icon' href='{DOCS_ASSETS}/favicon-32x32.png'>",
            )
        ],
        tags=[
            Tag(name=alarms.TAG, description="Alarm lifecycle (behaviour §5)."),
            Tag(name=commands.TAG, description="Downlink commands (behaviour §7)."),
            Tag(name=campaigns.TAG, description="Command campaigns (behaviour §7)."),
            Tag(name=notify.TAG, description="Notifications: silences, deliveries (behaviour §6)."),
            Tag(name=health.TAG, description="Health, metrics, this document."),
            Tag(name=devices.TAG, description="Devices and their telemetry (behaviour §2, §3)."),
            Tag(name=dead_letters.TAG, description="Dead letters, for admins (behaviour §3)."),
            Tag(name=stream.TAG, description="The live stream of outbox events."),
            Tag(name=session.TAG, description="Who the caller is."),
        ],
        components=Components(
            schemas={JSON_VALUE: JSON_VALUE_SCHEMA},
            security_schemes={
                BEARER_SCHEME: SecurityScheme(
                    type="http",
                    scheme="bearer",
                    description=(
                        "A token from `[[api.tokens]]` in the configuration; an operation's "
                        "`security` lists the weakest role it accepts."
                    ),
                )
            },
        ),
        use_handler_docstrings=False,
        create_examples=False,
    )


T = TypeVar("T")


def _after_call(service: Callable[[], T]) -> Callable[[CallDep], T]:
    """A service's dependency, resolved after ``call``. Dependencies that depend on nothing are
    resolved together, in an anyio task group spawning a task each, on every request (litestar's
    ``resolve_dependencies``): 5-10 % of the gateway's CPU under a burst of command requests.
    Chained behind ``call`` (which every guarded route has), they are resolved one after the
    other, inline."""

    def provide(call: CallDep) -> T:
        return service()

    return provide


def build_app(
    *,
    health_check: HealthCheck,
    metrics: Metrics,
    auth: BearerAuth,
    services: Services,
) -> Litestar:
    """The whole HTTP surface of a node. ``auth.replace`` swaps its tokens at run time;
    ``services`` are filled in once the node has a database."""
    guarded = Router(
        "/",
        route_handlers=[
            *alarms.HANDLERS,
            *commands.HANDLERS,
            *campaigns.HANDLERS,
            *devices.HANDLERS,
            *dead_letters.HANDLERS,
            *figures.HANDLERS,
            *rules.HANDLERS,
            *session.HANDLERS,
            stream.create_ticket,
            *notify.HANDLERS,
        ],
        parameters={
            "request_id": HeaderParameter(
                annotation=str,
                name=REQUEST_ID_HEADER,
                required=False,
                min_length=1,
                max_length=REQUEST_ID_MAX_LENGTH,
                pattern=REQUEST_ID_PATTERN,
                description=(
                    "Recorded with a change in the audit trail and echoed in the answer; a UUID "
                    "is generated when absent."
                ),
            )
        },
    )
    allow: dict[BaseRouteHandler, str] = {}
    assets = create_static_files_router(
        path=DOCS_ASSETS, directories=[swagger_ui_path], include_in_schema=False
    )
    app = Litestar(
        route_handlers=[
            *health.HANDLERS,
            openapi_document,
            guarded,
            stream.stream,
            assets,
            *console_routes(),
        ],
        dependencies={
            "alarms": Provide(_after_call(services.alarm_service), sync_to_thread=False),
            "commands": Provide(_after_call(services.command_service), sync_to_thread=False),
            "notifications": Provide(_after_call(services.notify_service), sync_to_thread=False),
            "call": Provide(call_of, sync_to_thread=False),
            "pool": Provide(_after_call(services.database), sync_to_thread=False),
        },
        exception_handlers={Exception: handle_exception},
        before_request=check_inputs,
        before_send=[echo_request_id, _allow_every_method(allow)],
        openapi_config=_openapi_config(),
        request_max_body_size=MAX_BODY_BYTES,
        state=State(
            {
                "auth": auth,
                "health_check": health_check,
                "metrics": metrics,
                STATE_SERVICES: services,
                STATE_NO_HEAD: NO_HEAD,
            }
        ),
        logging_config=None,
        debug=False,
    )
    for served in app.routes:
        if isinstance(served, HTTPRoute) and "OPTIONS" in served.route_handler_map:
            options, _ = served.route_handler_map["OPTIONS"]
            allow[options] = ", ".join(sorted(served.methods))
    stream.complete(app.openapi_schema)
    _complete(app.openapi_schema)
    return app


def _complete(document: OpenAPI) -> None:
    """What Litestar's generation leaves out, added from the same declarations, and what it
    renders in a way the served answers would not match, corrected."""
    found_schemas, parameters = _schemas_and_parameters(document)
    for schema in found_schemas:
        _overlapping_union_as_any_of(schema)
    for parameter in parameters:
        _absent_not_null(parameter)
    schemas = document.components.schemas or {}
    # `params`' recursive schema: no Python type spells it, so it joins the generated ones here.
    schemas[JSON_VALUE] = JSON_VALUE_SCHEMA
    notify.complete(schemas)
    campaigns.complete(schemas)
    health.complete(schemas)
    for name, renamed in DEPRECATED_PROPERTIES.items():
        properties = schemas[name].properties if name in schemas else None
        for old, new in renamed.items():
            if properties is not None and isinstance(properties.get(old), Schema):
                kept = properties[old]
                assert isinstance(kept, Schema)
                kept.deprecated = True
                kept.description = f"Deprecated: the same as `{new}`, under its first name."
    complete_desk(schemas)
    # A body Struct that forbids unknown fields says so (msgspec refuses them: a 422).
    for body in (
        ActionBody,
        CommandBody,
        DeviceCommandBody,
        notify.SilenceBody,
        *campaigns.BODIES,
        *DESK_BODIES,
    ):
        if body.__struct_config__.forbid_unknown_fields and body.__name__ in schemas:
            schemas[body.__name__].additional_properties = False


def _schemas_and_parameters(document: OpenAPI) -> tuple[list[Schema], list[Parameter]]:
    """Every ``Schema`` and every ``Parameter`` in the document's object tree (Litestar's spec
    dataclasses, lists and dicts, raw ``schema_extra`` dicts among them), each once, found
    before any is changed. One walk with a stack and each class's field names read once: the
    document has some 78,000 nodes (69,000 of them unset fields), and a recursive generator
    over ``dataclasses.fields`` took a third of building the app (0.13 of 0.33 s), paid at
    every start."""
    schemas: list[Schema] = []
    parameters: list[Parameter] = []
    seen: set[int] = set()
    names: dict[type, tuple[str, ...]] = {}
    stack: list[Any] = [document]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        if isinstance(node, dict):
            seen.add(id(node))
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            seen.add(id(node))
            stack.extend(node)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            seen.add(id(node))
            if isinstance(node, Schema):
                schemas.append(node)
            elif isinstance(node, Parameter):
                parameters.append(node)
            kind = type(node)
            fields = names.get(kind)
            if fields is None:
                fields = names[kind] = tuple(f.name for f in dataclasses.fields(node))
            for name in fields:  # most fields are None (69,000 of 78,000 nodes): left out
                child = getattr(node, name)
                if child is not None:
                    stack.append(child)
    return schemas, parameters


def _overlapping_union_as_any_of(schema: Schema) -> None:
    """Litestar renders every union as ``oneOf``, which holds a value to exactly one branch. A
    union of ``int`` and ``float`` (a metric: ``int | float | bool | str``) has an ``integer``
    and a ``number`` branch, and an integer matches both: the document would refuse every
    integer the API serves. Its branches are alternatives that may overlap: ``anyOf``."""
    branches = schema.one_of or []
    types = {b.type for b in branches if isinstance(b, Schema) and isinstance(b.type, OpenAPIType)}
    if {OpenAPIType.INTEGER, OpenAPIType.NUMBER} <= types:
        schema.any_of, schema.one_of = list(branches), None


def _not_null(schema: Schema | Reference) -> bool:
    return not (isinstance(schema, Schema) and schema.type == OpenAPIType.NULL)


def _absent_not_null(parameter: Parameter) -> None:
    """An optional parameter (``X | None = None``) is rendered nullable, but no query string or
    header can carry a JSON null, and the text ``null`` is not a value either (the boundary
    refuses it: :func:`gateway.api.routes.check_inputs`): the parameter is absent or an ``X``."""
    schema = parameter.schema
    if not isinstance(schema, Schema):
        return
    if schema.enum is not None:  # a Literal: its values, and None
        schema.enum = [value for value in schema.enum if value is not None]
    if isinstance(schema.type, list):
        schema.type = [kind for kind in schema.type if kind != OpenAPIType.NULL]
    if schema.one_of is not None:
        kept = [branch for branch in schema.one_of if _not_null(branch)]
        if len(kept) == 1 and isinstance(kept[0], Reference):
            # Litestar repeats the description on the parameter: nothing is lost.
            parameter.schema = kept[0]
        else:
            schema.one_of = kept
