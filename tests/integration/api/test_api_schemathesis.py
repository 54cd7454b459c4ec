"""Schemathesis against the generated document, on a live daemon with a seeded database.

One ``gateway run`` (a real process, real PostgreSQL, a real broker) with a viewer, an operator
and an admin token; some alarms and commands exist, and a device that sent telemetry (integer,
float, boolean and text metrics, over MQTT). Every operation of ``/openapi.json`` gets
generated requests (schema-valid and not, a fixed seed, bounded examples), and each request is
sent once with each role's token. Whatever the request: no 5xx, and every answer conforms to
the document (status, content type, body, headers). A schema-valid request is never refused,
except as the document says it may be for the state or the role: 404 for an id that does not
exist, 409 for a conflict, 400 ``ILLEGAL_TRANSITION``/``ALARM_SUPERSEDED`` for a step the alarm
or the command cannot take now, 403 for a role weaker than the operation's ``security`` names.
Requests generation seldom or never makes are sent as they are, with a known answer: the
device's telemetry and latest values (integers among them), and the text ``null`` for optional
parameters (a 400, as for any value the document does not allow).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlencode

import aiomqtt
import asyncpg
import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.alarms.lifecycle import create_alarm
from gateway.alarms.service import AlarmService
from gateway.api.app import build_app
from gateway.api.auth import BearerAuth
from gateway.api.services import Services
from gateway.commands.service import CommandService
from gateway.support.metrics import Metrics
from protocol import Topics
from storage.alarms import db_now
from tests.support.api_client import ADMIN, OPERATOR, VIEWER
from tests.support.api_server import healthy
from tests.support.daemon import DaemonProcess, config_toml
from tests.support.dsn import with_database
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until_sync

TOKENS: Final = {"viewer": VIEWER, "operator": OPERATOR, "admin": ADMIN}
ROLES: Final = ("viewer", "operator", "admin")
# Refusals a schema-valid request may get, by status: they depend on the state, not the input.
STATE_DEPENDENT: Final = {
    # The desk's: a shelf's length and a bulk action's size are bounded by the configuration
    # ([alarms] shelve_max_s, bulk_max), an out-of-service `until` by the clock.
    400: {
        "ILLEGAL_TRANSITION",
        "ALARM_SUPERSEDED",
        "SHELF_TOO_LONG",
        "TOO_MANY_ALARMS",
        "UNTIL_PAST",
    },
    404: {"NOT_FOUND"},
    # NO_TARGETS: a campaign's selector is resolved against the devices known at the time.
    409: {
        "STATUS_CHANGED",
        "DEVICE_UNBOUND",
        "NO_TARGETS",
        "ALREADY_SHELVED",
        "SHELF_ENDED",
        "NOT_OUT_OF_SERVICE",
    },
    # A command to a Sparkplug device is a metric write (`{"value": v}`): what its params must
    # be depends on the id (a command's `device_id`, a campaign's resolved targets), which the
    # document says in words, not in the schema.
    422: {"SPARKPLUG_WRITE_INVALID"},
    # Each token gets stream tickets at a bounded rate, whatever the request.
    429: {"TOO_MANY_TICKETS"},
}
MAX_EXAMPLES: Final = 60  # per operation, each sent with three tokens: about 2 minutes
# A generated `wait` is scaled down to keep the run bounded (a 60 s wait is a valid request,
# and nothing answers the commands here): 60 s becomes 0.3 s.
WAIT_SCALE: Final = 200
CONFIG_EXTRA: Final = (
    "".join(
        f'\n[[api.tokens]]\ntoken = "{token}"\nrole = "{role}"\nname = "{role}-token"\n'
        for role, token in TOKENS.items()
    )
    + "\n[commands]\nack_window_s = 0.5\nreaper_interval_s = 0.2\n"
)
METER: Final = "meter-1"
# One of each metric type: an integer is also a number, which a oneOf in the document refused.
METER_SAMPLES: Final = [
    {"ts": "2026-11-30T12:00:00Z", "seq": 1, "metrics": {"count": 3, "temp": 21.5}},
    {"ts": "2026-11-30T12:00:01Z", "seq": 2, "metrics": {"count": 4, "door": True, "mode": "a"}},
]


@dataclass
class Live:
    base: str
    dsn: str
    daemon: DaemonProcess
    counts: dict[str, int] = field(default_factory=dict)


async def _create_database(server_dsn: str, template: str) -> str:
    name = f"gw_st_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    finally:
        await admin.close()
    return name


async def _drop_database(server_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def _seed_alarms(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for n in range(6):
            async with conn.transaction():
                await create_alarm(
                    conn, device_id=f"dev-{n % 3}", rule_key=f"rule-{n % 2}", severity="MAJOR",
                    telemetry_event_id=uuid.uuid4().hex, reason="seed", node_id="seed",
                    now=await db_now(conn),
                )  # fmt: skip
    finally:
        await conn.close()


async def _send_telemetry(mqtt_port: int) -> None:
    async with aiomqtt.Client("127.0.0.1", mqtt_port) as device:
        for sample in METER_SAMPLES:
            payload = msgspec.json.encode(sample)
            await device.publish(Topics("iot").telemetry(METER), payload, qos=1)


def _telemetry_stored(base: str) -> bool:
    reply = httpx.get(
        f"{base}/devices/{METER}/telemetry", headers={"Authorization": f"Bearer {VIEWER}"}
    )
    return reply.status_code == 200 and len(reply.json()["samples"]) == len(METER_SAMPLES)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def live(
    pg_server_dsn: str, template_db: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    workdir: Path = tmp_path_factory.mktemp("schemathesis")
    name = asyncio.run(_create_database(pg_server_dsn, template_db))
    dsn = with_database(pg_server_dsn, name)
    broker = Mosquitto(workdir / "mosquitto")
    broker.start()
    port = free_port()
    config = workdir / "gateway.toml"
    config.write_text(config_toml(dsn=dsn, mqtt_port=broker.port, http_port=port,
                                  extra=CONFIG_EXTRA, log_level="info"))  # fmt: skip
    daemon = DaemonProcess(config, workdir / "gateway.log")
    base = f"http://127.0.0.1:{port}"
    try:
        daemon.start()
        wait_until_sync(lambda: _healthy(base), timeout=60, message="daemon healthy")
        asyncio.run(_seed_alarms(dsn))
        asyncio.run(_send_telemetry(broker.port))
        wait_until_sync(lambda: _telemetry_stored(base), timeout=30, message="telemetry stored")
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {OPERATOR}"}) as http:
            for n in range(4):
                reply = http.post(f"/devices/dev-{n % 2}/commands", json={"name": f"c{n}"})
                assert reply.status_code == 201, reply.text
            assert http.post("/devices/dev-gone/unbind").status_code == 200
        served = Live(base=base, dsn=dsn, daemon=daemon)
        yield served
        print(f"\nschemathesis: {sum(served.counts.values())} requests, by role {served.counts}")
    finally:
        if daemon.alive():
            daemon.terminate()
        broker.stop()
        asyncio.run(_drop_database(pg_server_dsn, name))


def _document() -> dict[str, Any]:
    """The document the daemon serves, generated here at collection time (no daemon yet: the
    test checks that the served one is the same)."""
    app = build_app(
        health_check=healthy, metrics=Metrics(), auth=BearerAuth([]),
        services=Services(
            alarms=AlarmService(None, "doc"), commands=CommandService(None, "doc", 1.0)
        ),
    )  # fmt: skip
    document: dict[str, Any] = msgspec.json.decode(
        msgspec.json.encode(app.openapi_schema.to_schema())
    )
    return document


DOCUMENT: Final = _document()
# GET /stream never ends (it is an event stream): test_stream_api and test_stream_nodes test it.
schema = schemathesis.openapi.from_dict(DOCUMENT).exclude(path="/stream", method="GET")


def test_the_served_document_is_the_one_tested(live: Live) -> None:
    served = httpx.get(f"{live.base}/openapi.json", timeout=10).json()
    assert served == DOCUMENT


_CHECKS: Final = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


def _required_role(case: Any) -> str | None:
    security = case.operation.definition.raw.get("security") or []
    for requirement in security:
        for roles in requirement.values():
            if roles:
                return str(roles[0])
    return None


def _error_code(response: Any) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("error") if isinstance(body, dict) else None


def _judge(case: Any, response: Any, role: str) -> None:
    status = response.status_code
    where = f"{case.method} {case.formatted_path} as {role}: {status} {response.text[:300]}"
    assert status < 500, where
    meta = case.meta
    positive = meta is None or meta.generation.mode.is_positive
    if not positive or status < 400:
        return
    required = _required_role(case)
    if status == 403:
        assert required is not None, where
        assert ROLES.index(role) < ROLES.index(required), where
        return
    assert _error_code(response) in STATE_DEPENDENT.get(status, set()), (
        f"a schema-valid request was refused: {where}"
    )


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
    suppress_health_check=list(HealthCheck),
)  # fmt: skip
def test_generated_requests(case: Any, live: Live) -> None:
    wait = case.query.get("wait") if isinstance(case.query, dict) else None
    if isinstance(wait, (int, float)) and not isinstance(wait, bool):
        case.query["wait"] = wait / WAIT_SCALE
    for role in ROLES:
        response = case.call(
            base_url=live.base, headers={"Authorization": f"Bearer {TOKENS[role]}"}, timeout=30
        )
        live.counts[role] = live.counts.get(role, 0) + 1
        _judge(case, response, role)
        case.validate_response(response, checks=_CHECKS)


# (path, path parameters, query, status): an integer metric in an answer, and `null` where an
# optional parameter is not a string (`null` is no value of it: absent is how one says none).
KNOWN: Final[list[tuple[str, dict[str, str], dict[str, Any], int]]] = [
    ("/devices/{id}", {"id": METER}, {}, 200),
    ("/devices/{id}/telemetry", {"id": METER}, {}, 200),
    ("/devices/{id}/telemetry", {"id": METER}, {"metric": "count", "limit": 1}, 200),
    ("/devices", {}, {"presence": "null"}, 400),
    ("/devices/{id}/telemetry", {"id": METER}, {"until": "null"}, 400),
    ("/devices/{id}/telemetry", {"id": METER}, {"since": "null"}, 400),
    ("/commands", {}, {"status": "null"}, 400),
]


def _integer_metric(body: Any) -> Any:
    if "device" in body:
        return body["device"]["latest_metrics"]["count"]["value"]
    return body["samples"][0]["metrics"]["count"]


@pytest.mark.parametrize(
    ("path", "path_parameters", "query", "status"),
    KNOWN,
    ids=[f"{p}?{urlencode(q)}" for p, _, q, _ in KNOWN],
)
def test_known_requests(
    path: str, path_parameters: dict[str, str], query: dict[str, Any], status: int, live: Live
) -> None:
    case = schema[path]["GET"].Case(path_parameters=path_parameters, query=query)
    response = case.call(
        base_url=live.base, headers={"Authorization": f"Bearer {VIEWER}"}, timeout=30
    )
    assert response.status_code == status, response.text
    body = response.json()
    if status == 400:
        assert (body["error"], body["param"]) == ("BAD_REQUEST", next(iter(query))), body
    else:
        metric = _integer_metric(body)  # the newest sample's
        assert (type(metric), metric) == (int, 4), body
    case.validate_response(response, checks=_CHECKS)
