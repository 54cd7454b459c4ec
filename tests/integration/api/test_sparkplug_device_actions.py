"""An operator's per-device actions on a Sparkplug device, over real HTTP against real
PostgreSQL. A Sparkplug id (`{group}/{node}/{device}`) cannot travel in a path: its `/` splits
`/devices/{id}/out-of-service` and `/devices/{id}/unbind` (an encoded `%2F` is decoded before
routing), so an operator could not put a Sparkplug device out of service for maintenance, nor
unbind it: the router's 404. Each action takes the id in the query too, as `GET /device?id=`
does (docs/api.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import quote

import aiohttp
import asyncpg
import pytest

from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.integration.api.test_alarm_desk_audit import Api
from tests.support.api_client import OPERATOR, VIEWER
from tests.support.api_server import serve_api

OVEN = "Plant1/Line4/Oven"
EDGE = "Plant1/Line4"


def q(device: str) -> str:
    return f"?id={quote(device, safe='')}"


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


async def _known(api: Api, *devices: str) -> None:
    for device in devices:
        await api.db.execute(
            "INSERT INTO device (device_id, first_seen, last_seen) VALUES ($1, now(), now())",
            device,
        )


async def test_a_sparkplug_device_goes_out_of_service_and_back_by_its_id_in_the_query(
    api: Api,
) -> None:
    await _known(api, OVEN, EDGE, "m1")
    # The path cannot name it: the router's 404, as before.
    split = await api.call(
        "PUT", f"/devices/{quote(OVEN, safe='')}/out-of-service", json={"reason": "x"},
        token=OPERATOR,
    )  # fmt: skip
    assert split.status == 404, split.body

    put = await api.call(
        "PUT", f"/device/out-of-service{q(OVEN)}", json={"reason": "door seal"}, token=OPERATOR
    )
    assert put.status == 200, put.body
    assert (put.body["device_id"], put.body["reason"], put.body["set_by"]) == (
        OVEN, "door seal", "console",
    )  # fmt: skip
    shown = await api.get(f"/device{q(OVEN)}")
    assert shown.body["device"]["out_of_service"]["id"] == put.body["id"]
    alarm_id = await api.raise_alarm(OVEN)
    assert (await api.get(f"/alarms/{alarm_id}")).body["out_of_service"] is True
    # The edge node itself (two levels) and a native id take the same route.
    for other in (EDGE, "m1"):
        reply = await api.call(
            "PUT", f"/device/out-of-service{q(other)}", json={"reason": "r"}, token=OPERATOR
        )
        assert (reply.status, reply.body["device_id"]) == (200, other), reply.body

    ended = await api.call("DELETE", f"/device/out-of-service{q(OVEN)}", token=OPERATOR)
    assert (ended.status, ended.body["ended_by"]) == (200, "console"), ended.body
    assert (await api.get(f"/device{q(OVEN)}")).body["device"]["out_of_service"] is None
    again = await api.call("DELETE", f"/device/out-of-service{q(OVEN)}", token=OPERATOR)
    assert (again.status, again.body["error"]) == (409, "NOT_OUT_OF_SERVICE")
    unknown = await api.call(
        "PUT", f"/device/out-of-service{q('Plant1/Line4/Nope')}", json={"reason": "x"},
        token=OPERATOR,
    )  # fmt: skip
    assert (unknown.status, unknown.body["error"]) == (404, "NOT_FOUND")
    viewer = await api.call(
        "PUT", f"/device/out-of-service{q(OVEN)}", json={"reason": "x"}, token=VIEWER
    )
    assert viewer.status == 403
    before = await api.db.fetchval("SELECT count(*) FROM device_out_of_service")
    for bad in ("Plant1/Line4/Oven/x", "Plant1//Oven", "/Oven", "Oven/", "Plant 1/Line4"):
        refused = await api.call(
            "PUT", f"/device/out-of-service{q(bad)}", json={"reason": "x"}, token=OPERATOR
        )
        assert (refused.status, refused.body["error"]) == (400, "BAD_REQUEST"), bad
    missing = await api.call("PUT", "/device/out-of-service", json={"reason": "x"}, token=OPERATOR)
    assert (missing.status, missing.body["error"]) == (400, "BAD_REQUEST")
    assert await api.db.fetchval("SELECT count(*) FROM device_out_of_service") == before


async def test_a_sparkplug_device_is_unbound_by_its_id_in_the_query(api: Api) -> None:
    # A Sparkplug command is a metric write: its params are {"value": v}.
    write = {"device_id": OVEN, "name": "Setpoint", "params": {"value": 180.0}}
    created = await api.post("/commands", write)
    assert created.status == 201, created.body
    command_id = created.body["command"]["id"]
    split = await api.post(f"/devices/{quote(OVEN, safe='')}/unbind", None)
    assert split.status == 404, split.body

    unbound = await api.post(f"/device/unbind{q(OVEN)}", None)
    assert unbound.status == 200, unbound.body
    assert unbound.body == {"device_id": OVEN, "cancelled": [command_id]}
    assert (await api.get(f"/commands/{command_id}")).body["command"]["status"] == "CANCELLED"
    refused = await api.post("/commands", write)
    assert (refused.status, refused.body["error"]) == (409, "DEVICE_UNBOUND")
    assert (await api.get(f"/device{q(OVEN)}")).body["device"]["bound"] is False
    bad = await api.post(f"/device/unbind{q('Plant1//Oven')}", None)
    assert (bad.status, bad.body["error"]) == (400, "BAD_REQUEST")
    viewer = await api.call("POST", f"/device/unbind{q(EDGE)}", token=VIEWER)
    assert viewer.status == 403


async def test_the_document_names_the_query_routes(api: Api) -> None:
    document = (await api.call("GET", "/openapi.json", token=None)).body
    assert {"put", "delete"} <= set(document["paths"]["/device/out-of-service"])
    assert "post" in document["paths"]["/device/unbind"]
