"""``/health`` and ``/metrics``: open to anyone, no token."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal

import msgspec
from litestar import Request, Response
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Schema
from litestar.openapi.spec.enums import OpenAPIType
from msgspec import UNSET, UnsetType

from gateway.api.routes import route
from gateway.support.metrics import Metrics

TAG: Final = "service"


class OutboxHealth(msgspec.Struct, kw_only=True):
    backlog: int
    oldest_age_s: float


class DatabaseHealth(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``ok`` with the pool and the outbox; or not, with the ``error``."""

    ok: bool
    error: str | UnsetType = UNSET
    # The server ("host:port") the pool's connections reach: with a multi-host DSN, the
    # member of the pair that is the primary now.
    server: str | UnsetType = UNSET
    pool_size: int | UnsetType = UNSET
    pool_idle: int | UnsetType = UNSET
    outbox: OutboxHealth | UnsetType = UNSET


class BrokerHealth(msgspec.Struct, kw_only=True):
    # Connected and every subscription acknowledged (telemetry can flow).
    ok: bool
    # The subscriptions of this connection acknowledged (false while reconnecting, and
    # while a resumed session's backlog comes before the SUBACK).
    subscribed: bool
    # The endpoint in use (connected to, or tried next): its host and port.
    address: tuple[str, int] | None
    # The endpoint connected to ("host:port", "[v6]:port"; null while not connected), and
    # every one configured ([mqtt] hosts), in order.
    endpoint: str | None = None
    endpoints: list[str] = msgspec.field(default_factory=list)
    connections: int


class IngestHealth(msgspec.Struct, kw_only=True):
    queued: int
    seconds_since_progress: float | None


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The node's health: 200 when the database answers and the broker is connected; 503
    with the ``reason`` otherwise, from the first second of a start (waiting for the
    database, starting the embedded PostgreSQL, connecting to the broker...)."""

    status: Literal["ok", "unhealthy"]
    reason: str | UnsetType = UNSET
    node_id: str
    version: str
    database: DatabaseHealth
    broker: BrokerHealth
    # Audit rows PostgreSQL refused since the node started (each one's change rolled back).
    audit_failures: int
    ingest: IngestHealth
    # The same count under its first, camelCase name: kept for monitors written against it
    # (deprecated; every other key is snake_case).
    # (Set from `audit_failures` whatever is passed: UNSET only until then, never encoded so.)
    audit_failures_legacy: int | UnsetType = msgspec.field(default=UNSET, name="auditFailures")

    def __post_init__(self) -> None:
        self.audit_failures_legacy = self.audit_failures


def complete(schemas: dict[str, Schema]) -> None:
    """`auditFailures` as it is sent: always, an integer, deprecated for `audit_failures`."""
    health = schemas.get(Health.__name__)
    if health is None or health.properties is None:
        return
    health.properties["auditFailures"] = Schema(
        type=OpenAPIType.INTEGER,
        deprecated=True,
        description="Deprecated: `audit_failures` under its first name, kept for old monitors.",
    )
    health.required = sorted({*(health.required or []), "auditFailures"})


HealthCheck = Callable[[], Awaitable[tuple[bool, Health]]]


_UNHEALTHY: Final = ResponseSpec(
    data_container=Health,
    generate_examples=False,
    description="Not healthy; the body says what is wrong.",
)


@route(
    "GET",
    "/health",
    operation_id="health",
    tag=TAG,
    role=None,
    also={503: _UNHEALTHY},
    summary="Node health: database, broker, backlog, audit failures, version",
)
async def health(request: Request[Any, Any, Any]) -> Response[Health]:
    check: HealthCheck = request.app.state["health_check"]
    healthy, body = await check()
    return Response(body, status_code=200 if healthy else 503)


@route(
    "GET",
    "/metrics",
    operation_id="metrics",
    tag=TAG,
    role=None,
    media_type="text/plain",
    summary="Prometheus metrics (`gateway_` prefix), text exposition format",
)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    registry: Metrics = request.app.state["metrics"]
    payload, content_type = registry.render()
    return Response(payload, media_type=content_type)


HANDLERS: Final = [health, metrics]
