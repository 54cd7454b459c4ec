"""The operator command API over real HTTP (loopback) against a real PostgreSQL (behaviour §7, §9).

The expected outcomes are written from docs/behaviour.md, not read from the code; the end-to-end
tests run a real daemon and simulated devices on a real broker, and wait for the outcome in one
call.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import asyncpg
import pytest
from litestar import Litestar

from gateway.commands.lifecycle import CommandNotFoundError, cancel, mark_sent, unbind
from gateway.commands.receipts import apply_receipt
from gateway.commands.service import CommandService
from gateway.config import TokenConfig
from protocol import CommandReceipt, ReceiptResult, Topics
from sim.responder import Behaviour, Responder, Script
from storage import commands as command_repo
from tests.support.api_client import ADMIN, OPERATOR, VIEWER, ApiClient, Reply
from tests.support.api_server import serve_api
from tests.support.daemon import make_config, running_daemon
from tests.support.held_batch import first_batch_held, queue_in_order
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]
OPEN = ("PENDING", "CLAIMED", "SENT")
# behaviour §9 / the brief: what a command in the API carries at least.
COMMAND_FIELDS = {
    "id", "device_id", "name", "params", "status", "delivery", "claim_generation",
    "claimed_node_id", "retry_count", "reclaim_count", "result", "result_code",
    "raw_result_code", "created_at", "finished_at",
}  # fmt: skip
RECEIPT_FIELDS = {
    "outcome", "reason", "result", "result_code", "raw_result_code", "raw_ack",
    "claim_generation", "node_id", "received_at",
}  # fmt: skip


@dataclass
class Api(ApiClient):
    app: Litestar
    db: asyncpg.Connection
    service: CommandService
    db_dsn: str

    async def send(
        self, device: str, body: Any, *, query: str = "", token: str | None = OPERATOR
    ) -> Reply:
        return await self.call("POST", f"/devices/{device}/commands{query}", json=body, token=token)

    async def create(self, device: str, name: str = "reboot", **fields: Any) -> dict[str, Any]:
        reply = await self.send(device, {"name": name, **fields})
        assert reply.status == 201, reply.body
        assert reply.body["created"] is True
        command: dict[str, Any] = reply.body["command"]
        return command

    async def command(self, command_id: int) -> dict[str, Any]:
        reply = await self.get(f"/commands/{command_id}")
        assert reply.status == 200, reply.body
        body: dict[str, Any] = reply.body
        return body

    async def snapshot(self) -> tuple[list[asyncpg.Record], int, int]:
        """Every command row, and how many audit rows and outbox events there are."""
        rows = await self.db.fetch("SELECT * FROM command ORDER BY id")
        audit = await self.db.fetchval("SELECT count(*) FROM command_audit")
        events = await self.db.fetchval(
            "SELECT count(*) FROM outbox_event WHERE aggregate_type = 'command'"
        )
        return rows, audit, events


@contextlib.asynccontextmanager
async def serve(dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    """The alarm and command APIs, wired as the daemon wires them, on a loopback port."""
    async with (
        serve_api(dsn, TOKENS) as served,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200)) as http,
    ):
        yield Api(
            base=served.base, http=http, app=served.app, db=db, service=served.commands,
            db_dsn=dsn,
        )  # fmt: skip


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve(db_dsn, db) as served:
        yield served


# --- create, get, list --------------------------------------------------------------------------


async def test_create_get_and_list_with_keyset_pages(api: Api) -> None:
    reply = await api.send(
        "dev-1", {"name": "set", "params": {"level": 3, "tags": ["a"]}, "delivery": "deferrable"},
        token=OPERATOR,
    )  # fmt: skip
    assert reply.status == 201, reply.body
    assert reply.body["created"] is True
    first = reply.body["command"]
    assert set(first) >= COMMAND_FIELDS
    assert "legacy_claim" not in first
    assert first["device_id"] == "dev-1"
    assert (first["name"], first["params"], first["delivery"]) == (
        "set", {"level": 3, "tags": ["a"]}, "deferrable",
    )  # fmt: skip
    assert (first["status"], first["claim_generation"], first["claimed_node_id"]) == (
        "PENDING", 0, None,
    )  # fmt: skip
    assert (first["retry_count"], first["reclaim_count"]) == (0, 0)
    assert (first["result"], first["result_code"], first["raw_result_code"]) == (None, None, None)
    assert first["finished_at"] is None
    assert first["created_by"] == "console"  # the operator token's name

    # Defaults: realtime, no params, no key.
    second = await api.create("dev-1", "reboot")
    assert (second["delivery"], second["params"], second["idempotency_key"]) == (
        "realtime", {}, None,
    )  # fmt: skip

    detail = await api.command(first["id"])
    assert detail == {"command": first, "receipts": []}
    audit = await api.db.fetch(
        "SELECT actor, action, from_status, to_status FROM command_audit WHERE command_id = $1",
        first["id"],
    )
    assert [tuple(r) for r in audit] == [("console", "create", None, "PENDING")]

    ids = [first["id"], second["id"]]
    ids += [(await api.create("dev-1", f"c{n}"))["id"] for n in range(3)]
    other = await api.create("dev-2")  # another device's command never shows up
    newest_first = sorted(ids, reverse=True)

    whole = await api.get("/devices/dev-1/commands")
    assert whole.status == 200, whole.body
    assert [c["id"] for c in whole.body["items"]] == newest_first
    assert whole.body["next_before"] is None
    assert whole.body["items"][-1] == first

    assert await api.keyset_ids("/devices/dev-1/commands?limit=2") == newest_first
    # A full last page promises no further page.
    exact = await api.get(f"/devices/dev-1/commands?limit=2&before={newest_first[2]}")
    assert [c["id"] for c in exact.body["items"]] == newest_first[3:]
    assert exact.body["next_before"] is None

    assert [c["id"] for c in (await api.get("/devices/dev-2/commands")).body["items"]] == [
        other["id"]
    ]
    assert (await api.get("/devices/never-seen/commands")).body == {
        "items": [], "next_before": None,
    }  # fmt: skip


async def test_the_fleets_commands_newest_first_by_status_in_keyset_pages(api: Api) -> None:
    ids = [(await api.create(f"dev-{n % 3}", f"c{n}"))["id"] for n in range(7)]
    cancelled = {ids[1], ids[4]}
    for command_id in cancelled:
        reply = await api.call("POST", f"/commands/{command_id}/cancel", token=OPERATOR)
        assert reply.status == 200, reply.body
    newest_first = sorted(ids, reverse=True)

    whole = await api.get("/commands")  # a viewer may read it
    assert whole.status == 200, whole.body
    assert [c["id"] for c in whole.body["items"]] == newest_first
    assert {c["device_id"] for c in whole.body["items"]} == {"dev-0", "dev-1", "dev-2"}
    assert set(whole.body["items"][0]) >= COMMAND_FIELDS
    assert whole.body["next_before"] is None

    assert await api.keyset_ids("/commands?limit=3") == newest_first

    only = await api.get("/commands?status=CANCELLED")
    assert [c["id"] for c in only.body["items"]] == sorted(cancelled, reverse=True)
    pending = await api.get(f"/commands?status=PENDING&limit=2&before={newest_first[0]}")
    expected = [i for i in newest_first[1:] if i not in cancelled][:2]
    assert [c["id"] for c in pending.body["items"]] == expected
    assert pending.body["next_before"] == expected[-1]

    for bad in ("status=DONE", "limit=0", "before=abc", "before=0"):
        refused = await api.get(f"/commands?{bad}")
        assert refused.status == 400, (bad, refused.body)
        assert refused.body["error"] == "BAD_REQUEST", refused.body
    assert (await api.call("GET", "/commands", token=None)).status == 401


async def test_idempotency_key_returns_the_same_command(api: Api) -> None:
    body = {"name": "open", "params": {"door": 1}, "idempotency_key": "ticket-1"}
    first = await api.send("dev-1", body)
    assert (first.status, first.body["created"]) == (201, True)
    before = await api.snapshot()

    again = await api.send("dev-1", body)
    assert (again.status, again.body["created"]) == (200, False)
    assert again.body["command"] == first.body["command"]
    # The key names the command, whatever the second request says.
    changed = await api.send("dev-1", {**body, "name": "close", "params": {}})
    assert (changed.status, changed.body["created"]) == (200, False)
    assert changed.body["command"] == first.body["command"]
    assert await api.snapshot() == before  # no row, audit or event for a repeat

    # Keys are per device; another key is another command.
    elsewhere = await api.send("dev-2", body)
    assert (elsewhere.status, elsewhere.body["created"]) == (201, True)
    other_key = await api.send("dev-1", {**body, "idempotency_key": "ticket-2"})
    assert (other_key.status, other_key.body["created"]) == (201, True)
    assert len({first.body["command"]["id"], elsewhere.body["command"]["id"],
                other_key.body["command"]["id"]}) == 3  # fmt: skip


async def test_concurrent_requests_with_one_key_create_one_command(api: Api) -> None:
    body = {"name": "open", "idempotency_key": "race"}
    replies = await asyncio.gather(*(api.send("dev-race", body) for _ in range(20)))
    assert sorted(r.status for r in replies) == [200] * 19 + [201]
    assert len({r.body["command"]["id"] for r in replies}) == 1
    assert await api.db.fetchval("SELECT count(*) FROM command") == 1
    assert await api.db.fetchval("SELECT count(*) FROM command_audit") == 1


async def test_requests_batched_together_are_each_answered_as_if_alone(
    api: Api, db_dsn: str
) -> None:
    """Requests queued behind a creation in flight share its successor's transaction
    (docs/commands.md); each answer is still the one it would have got alone."""
    assert (await api.call("POST", "/devices/dev-gone/unbind", token=OPERATOR)).status == 200
    async with first_batch_held(api.service, db_dsn):
        tasks = await queue_in_order(
            api.service,
            [
                api.send("dev-1", {"name": "a"}),
                api.send("dev-gone", {"name": "refused"}),
                api.send("dev-1", {"name": "b", "idempotency_key": "k"}),
                api.send("dev-1", {"name": "c", "idempotency_key": "k"}),
                api.send("dev-1", {"name": "d"}, query="?wait=0"),
            ],
        )
    a, refused, b, c, d = await asyncio.gather(*tasks)
    assert [r.status for r in (a, refused, b, c, d)] == [201, 409, 201, 200, 201]
    assert (refused.body["error"], refused.body["device_id"]) == ("DEVICE_UNBOUND", "dev-gone")
    assert (b.body["created"], c.body["created"]) == (True, False)
    assert c.body["command"] == b.body["command"]
    ids = [r.body["command"]["id"] for r in (a, b, d)]
    assert ids == sorted(ids)  # arrival order
    assert [r.body["command"]["name"] for r in (a, b, d)] == ["a", "b", "d"]
    assert await api.db.fetchval(
        "SELECT count(DISTINCT xmin::text) FROM command WHERE device_id = 'dev-1'"
    ) == 1  # fmt: skip


async def test_bodies_at_the_limits_are_accepted(api: Api) -> None:
    command = await api.create(
        "a" * 64, "n" * 128, params={"deep": [[[[{"x": None}]]]], "s": "ü" * 1000},
        idempotency_key="k" * 256,
    )  # fmt: skip
    assert command["device_id"] == "a" * 64
    assert command["params"]["s"] == "ü" * 1000
    assert command["idempotency_key"] == "k" * 256
    odd = await api.create("dev_1.x:y-z", " spaced name ", params={"": "empty key is fine"})
    assert odd["name"] == " spaced name "


# --- bad input ----------------------------------------------------------------------------------

BAD_BODIES = {
    "malformed": b"{nope",
    "empty": b"",
    "trailing-garbage": b'{"name": "a"} x',
    "not-utf8": b'{"name": "\xff"}',
    "lone-surrogate": b'{"name": "\\ud800"}',
    "array": b"[]",
    "null": b"null",
    "no-name": b"{}",
    "unknown-field": b'{"name": "a", "priority": 1}',
    "empty-name": b'{"name": ""}',
    "blank-name": b'{"name": "  "}',
    "name-too-long": b'{"name": "' + b"n" * 129 + b'"}',
    "name-not-string": b'{"name": 7}',
    "nul-in-name": b'{"name": "a\\u0000b"}',
    "params-array": b'{"name": "a", "params": [1]}',
    "params-string": b'{"name": "a", "params": "x"}',
    "params-null": b'{"name": "a", "params": null}',
    "nul-in-params": b'{"name": "a", "params": {"k": ["\\u0000"]}}',
    "nul-in-params-key": b'{"name": "a", "params": {"\\u0000": 1}}',
    "params-too-deep": b'{"name": "a", "params": {"x": ' + b"[" * 5000 + b"]" * 5000 + b"}}",
    "params-too-large": b'{"name": "a", "params": {"x": "' + b"p" * 70_000 + b'"}}',
    "bad-delivery": b'{"name": "a", "delivery": "soon"}',
    "delivery-case": b'{"name": "a", "delivery": "REALTIME"}',
    "empty-key": b'{"name": "a", "idempotency_key": ""}',
    "blank-key": b'{"name": "a", "idempotency_key": " "}',
    "key-too-long": b'{"name": "a", "idempotency_key": "' + b"k" * 257 + b'"}',
    "key-not-string": b'{"name": "a", "idempotency_key": 5}',
}


@pytest.mark.parametrize("raw", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_bad_bodies_are_422_and_create_nothing(api: Api, raw: bytes) -> None:
    before = await api.snapshot()
    reply = await api.call(
        "POST", "/devices/dev-1/commands", token=OPERATOR, data=raw,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    assert reply.status == 422, reply.body
    assert reply.body["error"] == "INVALID_BODY"
    assert reply.body["message"]
    assert reply.body["detail"]
    assert await api.snapshot() == before


async def test_a_huge_body_is_413(api: Api) -> None:
    reply = await api.call(
        "POST", "/devices/dev-1/commands", token=OPERATOR,
        data=io.BytesIO(b'{"name": "a", "params": {"x": "' + b"a" * (2 * 1024 * 1024) + b'"}}'),
    )  # fmt: skip
    assert (reply.status, reply.body["error"]) == (413, "PAYLOAD_TOO_LARGE")
    assert (await api.snapshot())[0] == []


BAD_DEVICE_IDS = ("bad%20id", "a" * 65, "%C3%BC", "x%2Fy", "dev%00")
BAD_COMMAND_IDS = ("abc", "1.5", "-1", "0", "1e3", "99999999999999999999", "%C2%B2")


@pytest.mark.parametrize("bad_id", BAD_DEVICE_IDS)
async def test_bad_device_ids_are_400(api: Api, bad_id: str) -> None:
    for method, path, token in (
        ("POST", f"/devices/{bad_id}/commands", OPERATOR),
        ("GET", f"/devices/{bad_id}/commands", VIEWER),
        ("POST", f"/devices/{bad_id}/unbind", OPERATOR),
    ):
        reply = await api.call(method, path, token=token, json={"name": "a"})
        assert reply.status in {400, 404}, (path, reply.body)
        if reply.status == 404:  # "/" decoded splits the path: the router's 404, same shape
            assert "/" in bad_id.replace("%2F", "/")
            assert reply.body["error"] == "NOT_FOUND"
            continue
        assert (reply.body["error"], reply.body["param"]) == ("BAD_REQUEST", "id"), path
    assert await api.snapshot() == ([], 0, 0)
    assert await api.db.fetchval("SELECT count(*) FROM device") == 0


SPARKPLUG_DEVICE = "Plant1/Line4/Oven"


async def test_post_commands_takes_the_device_in_the_body_sparkplug_or_native(api: Api) -> None:
    """`POST /commands` is `POST /devices/{id}/commands` with the id in the body: a path cannot
    carry a Sparkplug id (`%2F` is decoded before routing, the path splits: the router's 404)."""
    split = await api.call(
        "POST", "/devices/Plant1%2FLine4%2FOven/commands", token=OPERATOR, json={"name": "a"}
    )
    assert (split.status, split.body["error"]) == (404, "NOT_FOUND")

    body = {
        "device_id": SPARKPLUG_DEVICE,
        "name": "setpoint",
        "params": {"value": 42.5},
        "delivery": "deferrable",
        "idempotency_key": "sp-1",
    }
    reply = await api.call("POST", "/commands", token=OPERATOR, json=body)
    assert reply.status == 201, reply.body
    assert reply.body["created"] is True
    command = reply.body["command"]
    assert set(command) >= COMMAND_FIELDS
    assert (command["device_id"], command["name"], command["params"], command["delivery"]) == (
        SPARKPLUG_DEVICE, "setpoint", {"value": 42.5}, "deferrable",
    )  # fmt: skip
    assert (command["status"], command["created_by"]) == ("PENDING", "console")
    # The same key again on the same device: that command, 200, nothing new.
    again = await api.call("POST", "/commands", token=OPERATOR, json={**body, "name": "other"})
    assert (again.status, again.body["created"]) == (200, False)
    assert again.body["command"]["id"] == command["id"]
    # The edge node itself (two levels) takes commands too (NCMD).
    rebirth = {"device_id": "Plant1/Line4", "name": "Node Control/Rebirth"}
    node = await api.call(
        "POST", "/commands", token=OPERATOR, json={**rebirth, "params": {"value": True}}
    )
    assert (node.status, node.body["command"]["device_id"]) == (201, "Plant1/Line4")
    # A Sparkplug command is a metric write: without a value it could never go out (it was
    # created, then FAILED unsent with INVALID_PARAMS): refused, nothing created.
    no_value = await api.call("POST", "/commands", token=OPERATOR, json=rebirth)
    assert (no_value.status, no_value.body["error"]) == (422, "SPARKPLUG_WRITE_INVALID")
    assert no_value.body["device_ids"] == ["Plant1/Line4"]

    # A native id: the same command as through its path, the same key space per device.
    native = await api.call(
        "POST", "/commands", token=OPERATOR, json={"device_id": "dev-1", "name": "reboot"}
    )
    assert native.status == 201, native.body
    assert (native.body["command"]["device_id"], native.body["command"]["delivery"]) == (
        "dev-1", "realtime",
    )  # fmt: skip
    listed = await api.get("/devices/dev-1/commands")
    assert [c["id"] for c in listed.body["items"]] == [native.body["command"]["id"]]
    # `wait` as on the path route: no dispatcher here, the command is still PENDING after it.
    waited = await api.call(
        "POST", "/commands?wait=0.2", token=OPERATOR, json={"device_id": "dev-1", "name": "x"}
    )
    assert (waited.status, waited.body["command"]["status"]) == (201, "PENDING")

    detail = await api.command(command["id"])
    assert detail["command"] == command
    audit = await api.db.fetch(
        "SELECT actor, action, to_status FROM command_audit WHERE command_id = $1", command["id"]
    )
    assert [tuple(r) for r in audit] == [("console", "create", "PENDING")]
    fleet = await api.get("/commands")
    assert {c["device_id"] for c in fleet.body["items"]} == {
        SPARKPLUG_DEVICE, "Plant1/Line4", "dev-1",
    }  # fmt: skip
    # One device's commands by query, a Sparkplug id among them, of one status or all.
    oven = await api.get("/commands?device=Plant1%2FLine4%2FOven")
    assert [c["id"] for c in oven.body["items"]] == [command["id"]]
    ones = await api.get("/commands?device=dev-1&limit=1")
    assert [c["device_id"] for c in ones.body["items"]] == ["dev-1"]
    rest = await api.get(f"/commands?device=dev-1&before={ones.body['next_before']}")
    assert [c["id"] for c in rest.body["items"]] == [native.body["command"]["id"]]
    assert rest.body["next_before"] is None
    await api.call("POST", f"/commands/{native.body['command']['id']}/cancel", token=OPERATOR)
    pending = await api.get("/commands?device=dev-1&status=PENDING")
    cancelled = await api.get("/commands?device=dev-1&status=CANCELLED")
    assert [c["id"] for c in pending.body["items"]] == [waited.body["command"]["id"]]
    assert [c["id"] for c in cancelled.body["items"]] == [native.body["command"]["id"]]
    for bad in ("a%2Fb%2Fc%2Fd", "a%2F%2Fb", "a%0A", "a%20b"):
        reply = await api.get(f"/commands?device={bad}")
        assert (reply.status, reply.body["error"], reply.body["param"]) == (
            400, "BAD_REQUEST", "device",
        ), (bad, reply.body)  # fmt: skip


@pytest.mark.parametrize(
    "bad_id",
    ["a/b/c/d", "a//b", "/a", "a/", "a b", "a/b\n", "a\n", "", "x" * 65 + "/y", "a/b%2Fc", 7],
)
async def test_post_commands_refuses_an_id_no_device_has_and_creates_nothing(
    api: Api, bad_id: object
) -> None:
    reply = await api.call(
        "POST", "/commands", token=OPERATOR, json={"device_id": bad_id, "name": "reboot"}
    )
    assert reply.status == 422, reply.body
    assert await api.snapshot() == ([], 0, 0)


async def test_post_commands_keeps_the_roles_and_the_unbound_refusal(api: Api) -> None:
    body = {"device_id": SPARKPLUG_DEVICE, "name": "setpoint", "params": {"value": 1}}
    viewer = await api.call("POST", "/commands", token=VIEWER, json=body)
    assert viewer.status == 403, viewer.body
    anonymous = await api.call("POST", "/commands", token=None, json=body)
    assert anonymous.status == 401, anonymous.body
    missing = await api.call("POST", "/commands", token=OPERATOR, json={"name": "reboot"})
    assert missing.status == 422, missing.body
    assert await api.snapshot() == ([], 0, 0)
    # An unbound device refuses through the body route as through the path.
    unbound = await api.call("POST", "/devices/dev-9/unbind", token=OPERATOR)
    assert unbound.status in {200, 201}, unbound.body
    refused = await api.call(
        "POST", "/commands", token=OPERATOR, json={"device_id": "dev-9", "name": "reboot"}
    )
    assert (refused.status, refused.body["error"]) == (409, "DEVICE_UNBOUND")
    assert (await api.snapshot())[0] == []


@pytest.mark.parametrize("bad_id", BAD_COMMAND_IDS)
async def test_bad_command_ids_are_400(api: Api, bad_id: str) -> None:
    for method, path, token in (
        ("GET", f"/commands/{bad_id}", VIEWER),
        ("POST", f"/commands/{bad_id}/cancel", OPERATOR),
    ):
        reply = await api.call(method, path, token=token)
        assert reply.status == 400, (path, reply.body)
        assert (reply.body["error"], reply.body["param"]) == ("BAD_REQUEST", "id")


BAD_QUERIES = {
    "/devices/d/commands?wait=-1": ("POST", "wait"),
    "/devices/d/commands?wait=61": ("POST", "wait"),
    "/devices/d/commands?wait=60.5": ("POST", "wait"),
    "/devices/d/commands?wait=nan": ("POST", "wait"),
    "/devices/d/commands?wait=inf": ("POST", "wait"),
    "/devices/d/commands?wait=0x1": ("POST", "wait"),
    "/devices/d/commands?wait=1e400": ("POST", "wait"),
    "/devices/d/commands?wait=" + "1" * 5000: ("POST", "wait"),
    "/devices/d/commands?wait=": ("POST", "wait"),
    "/devices/d/commands?wait=%201": ("POST", "wait"),
    "/devices/d/commands?wait=1_0": ("POST", "wait"),
    "/devices/d/commands?wait=%D9%A1": ("POST", "wait"),  # an Arabic-Indic one
    "/devices/d/commands?wait=1&wait=2": ("POST", "wait"),
    "/devices/d/commands?timeout=1": ("POST", "timeout"),
    "/devices/d/commands?limit=0": ("GET", "limit"),
    "/devices/d/commands?limit=501": ("GET", "limit"),
    "/devices/d/commands?limit=x": ("GET", "limit"),
    "/devices/d/commands?before=0": ("GET", "before"),
    "/devices/d/commands?before=abc": ("GET", "before"),
    "/devices/d/commands?before=1&before=2": ("GET", "before"),
    "/devices/d/commands?status=PENDING": ("GET", "status"),
}


@pytest.mark.parametrize(("query", "expected"), BAD_QUERIES.items(), ids=BAD_QUERIES.keys())
async def test_bad_query_parameters_are_400(
    api: Api, query: str, expected: tuple[str, str]
) -> None:
    method, param = expected
    reply = await api.call(method, query, token=OPERATOR, json={"name": "a"})
    assert reply.status == 400, reply.body
    assert (reply.body["error"], reply.body["param"]) == ("BAD_REQUEST", param)
    assert (await api.snapshot())[0] == []


async def test_unknown_command_is_404(api: Api) -> None:
    for method, path in (("GET", "/commands/4242"), ("POST", "/commands/4242/cancel")):
        reply = await api.call(method, path, token=OPERATOR)
        assert reply.status == 404, reply.body
        assert (reply.body["error"], reply.body["command_id"]) == ("NOT_FOUND", 4242)


# --- authentication -----------------------------------------------------------------------------


async def test_tokens_and_roles(api: Api) -> None:
    command = await api.create("dev-1")
    routes = [
        ("POST", "/devices/dev-1/commands", "operator"),
        ("GET", "/devices/dev-1/commands", "viewer"),
        ("GET", f"/commands/{command['id']}", "viewer"),
        ("POST", f"/commands/{command['id']}/cancel", "operator"),
        ("POST", "/devices/dev-1/unbind", "operator"),
    ]
    before = await api.snapshot()
    for method, path, _role in routes:
        for token, header in ((None, None), ("not-a-token", None), (None, "Basic abc")):
            reply = await api.call(
                method, path, token=token, json={"name": "a"},
                headers=None if header is None else {"Authorization": header},
            )  # fmt: skip
            assert reply.status == 401, (method, path)
            assert reply.body["error"] == "UNAUTHORIZED"
            assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    for method, path, role in routes:
        if role == "operator":
            reply = await api.call(method, path, token=VIEWER, json={"name": "a"})
            assert reply.status == 403, (method, path)
            assert (reply.body["error"], reply.body["required_role"]) == ("FORBIDDEN", "operator")
    assert await api.snapshot() == before
    # Stronger roles may do what weaker ones may; a viewer may read.
    assert (await api.get(f"/commands/{command['id']}", token=VIEWER)).status == 200
    admin = await api.send("dev-1", {"name": "a"}, token=ADMIN)
    assert (admin.status, admin.body["command"]["created_by"]) == (201, "root")


async def test_request_id_is_echoed(api: Api) -> None:
    reply = await api.call(
        "POST", "/devices/dev-1/commands", token=OPERATOR, json={"name": "a"},
        headers={"X-Request-Id": "req-7"},
    )  # fmt: skip
    assert (reply.status, reply.headers["X-Request-Id"]) == (201, "req-7")
    refused = await api.call(
        "POST", "/commands/999/cancel", token=OPERATOR, headers={"X-Request-Id": "req-8"}
    )
    assert (refused.status, refused.headers["X-Request-Id"]) == (404, "req-8")


# --- cancel and unbind --------------------------------------------------------------------------


async def test_cancel_pending_then_cancel_again_is_refused(api: Api) -> None:
    command = await api.create("dev-1")
    reply = await api.call("POST", f"/commands/{command['id']}/cancel", token=OPERATOR)
    assert reply.status == 200, reply.body
    assert reply.body["id"] == command["id"]
    assert reply.body["status"] == "CANCELLED"
    assert reply.body["finished_at"] is not None
    # The command as stored, and the status it left: nothing was sent.
    assert reply.body.pop("previous_status") == "PENDING"
    assert (await api.command(command["id"]))["command"] == reply.body
    audit = await api.db.fetch(
        "SELECT actor, action, from_status, to_status FROM command_audit "
        "WHERE command_id = $1 ORDER BY id",
        command["id"],
    )
    assert [tuple(r) for r in audit][-1] == ("console", "cancel", "PENDING", "CANCELLED")

    before = await api.snapshot()
    again = await api.call("POST", f"/commands/{command['id']}/cancel", token=OPERATOR)
    assert again.status == 400, again.body
    assert again.body["error"] == "ILLEGAL_TRANSITION"
    assert again.body["current_status"] == "CANCELLED"
    assert again.body["command_id"] == command["id"]
    assert await api.snapshot() == before

    # One the broker took: the answer says so (the device may carry it out).
    sent = await api.create("dev-2")
    (claimed,) = await command_repo.claim_due(
        api.db, node_id="n1", lease_s=60, limit=1, max_in_flight=1, actor="system:dispatcher"
    )
    assert await mark_sent(api.db, claimed, node_id="n1", sent_timeout_s=60)
    reply = await api.call("POST", f"/commands/{sent['id']}/cancel", token=OPERATOR)
    assert (reply.status, reply.body["status"]) == (200, "CANCELLED"), reply.body
    assert reply.body["previous_status"] == "SENT"


async def test_concurrent_cancels_have_one_winner(api: Api) -> None:
    command = await api.create("dev-1")
    replies = await asyncio.gather(
        *(api.call("POST", f"/commands/{command['id']}/cancel", token=OPERATOR) for _ in range(10))
    )
    assert [r.status for r in replies].count(200) == 1
    # A loser that read the command cancelled already is refused (400); one that read it open
    # and lost the write is told so (409): which, depends on when each read.
    for reply in replies:
        if reply.status != 200:
            assert (reply.status, reply.body["error"]) in {
                (400, "ILLEGAL_TRANSITION"), (409, "STATUS_CHANGED"),
            }, reply.body  # fmt: skip
            assert reply.body["current_status"] == "CANCELLED"
    cancels = await api.db.fetchval(
        "SELECT count(*) FROM command_audit WHERE command_id = $1 AND action = 'cancel'",
        command["id"],
    )
    assert cancels == 1


async def _waiting_on_a_lock(db: asyncpg.Connection) -> bool:
    waiting = await db.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    return bool(waiting)


@pytest.mark.parametrize(
    ("competitor", "status", "actor"),
    [("cancel", "CANCELLED", "op:alice"), ("receipt", "ACKED", "device"),
     ("unbind", "CANCELLED", "op:alice")],
)  # fmt: skip
async def test_a_cancel_that_loses_its_race_is_409_and_changes_nothing(
    api: Api, db_dsn: str, competitor: str, status: str, actor: str
) -> None:
    """behaviour §14: of two acting at once exactly one wins, the other gets 409. The request
    reads the command SENT; the competing change (another operator's cancel, the device's
    ACK, an unbind) commits between that read and the request's write: its transaction holds
    the row until the request's write waits for it."""
    command = await api.create("dev-1")
    (claimed,) = await command_repo.claim_due(
        api.db, node_id="n1", lease_s=60, limit=1, max_in_flight=1, actor="system:dispatcher"
    )
    assert await mark_sent(api.db, claimed, node_id="n1", sent_timeout_s=60)
    _, audit_before, events_before = await api.snapshot()
    other = await asyncpg.connect(api.db_dsn)
    try:
        held = other.transaction()
        await held.start()
        if competitor == "cancel":
            await cancel(other, command["id"], actor="op:alice", node_id="api")
        elif competitor == "receipt":
            receipt = CommandReceipt(
                command_id=command["id"], claim_generation=1, node_id="n1",
                result=ReceiptResult.ACKED, result_code=0,
            )  # fmt: skip
            await apply_receipt(
                other, device_id="dev-1", receipt=receipt, node_id="n1", sent_timeout_s=60
            )
        else:
            await unbind(other, "dev-1", actor="op:alice", node_id="api")
        request = asyncio.create_task(
            api.call("POST", f"/commands/{command['id']}/cancel", token=OPERATOR)
        )
        await wait_until(
            lambda: _waiting_on_a_lock(api.db), message="the cancel's write waits for the row"
        )
        await held.commit()
        reply = await request
    finally:
        await other.close()
    assert reply.status == 409, reply.body
    assert reply.body["error"] == "STATUS_CHANGED"
    assert (reply.body["current_status"], reply.body["actor"]) == (status, actor)
    assert reply.body["command_id"] == command["id"]
    assert f"already {status} by {actor}" in reply.body["message"]
    # Only the winner's change: its audit row and its command.finished event.
    rows, audit_after, events_after = await api.snapshot()
    assert (audit_after, events_after) == (audit_before + 1, events_before + 1)
    assert [r["status"] for r in rows] == [status]
    console = await api.db.fetchval(
        "SELECT count(*) FROM command_audit WHERE actor = 'console' AND action = 'cancel'"
    )
    assert console == 0


async def test_unbind_cancels_open_commands_and_refuses_new_ones(api: Api) -> None:
    open_ids = [(await api.create("dev-1", f"c{n}"))["id"] for n in range(3)]
    closed = await api.create("dev-1", "old")
    assert (await api.call("POST", f"/commands/{closed['id']}/cancel")).status == 200
    kept = await api.create("dev-2")

    reply = await api.call("POST", "/devices/dev-1/unbind", token=OPERATOR)
    assert reply.status == 200, reply.body
    assert reply.body == {"device_id": "dev-1", "cancelled": open_ids}
    for command_id in open_ids:
        command = (await api.command(command_id))["command"]
        assert command["status"] == "CANCELLED"
        assert command["finished_at"] is not None
    actors = await api.db.fetch(
        "SELECT DISTINCT actor, action FROM command_audit WHERE command_id = ANY($1::bigint[])"
        " AND to_status = 'CANCELLED'",
        open_ids,
    )
    assert [tuple(r) for r in actors] == [("console", "unbind")]
    assert (await api.command(kept["id"]))["command"]["status"] == "PENDING"

    before = await api.snapshot()
    refused = await api.send("dev-1", {"name": "reboot"})
    assert refused.status == 409, refused.body
    assert (refused.body["error"], refused.body["device_id"]) == ("DEVICE_UNBOUND", "dev-1")
    # Even a repeat of an earlier request is refused: the device takes no commands at all.
    keyed = await api.send("dev-1", {"name": "reboot", "idempotency_key": "k"})
    assert (keyed.status, keyed.body["error"]) == (409, "DEVICE_UNBOUND")
    assert await api.snapshot() == before

    # Unbinding again changes nothing; an unknown device is registered as unbound.
    assert (await api.call("POST", "/devices/dev-1/unbind")).body == {
        "device_id": "dev-1", "cancelled": [],
    }  # fmt: skip
    unknown = await api.call("POST", "/devices/dev-new/unbind", token=OPERATOR)
    assert unknown.body == {"device_id": "dev-new", "cancelled": []}
    assert (await api.send("dev-new", {"name": "a"})).status == 409
    # Its history stays readable.
    listed = await api.get("/devices/dev-1/commands")
    assert len(listed.body["items"]) == 4


# --- waiting for the outcome --------------------------------------------------------------------


async def test_wait_without_a_dispatcher_ends_pending(api: Api) -> None:
    started = time.monotonic()
    reply = await api.send("dev-1", {"name": "reboot"}, query="?wait=0.3")
    elapsed = time.monotonic() - started
    assert reply.status == 201, reply.body
    assert reply.body["command"]["status"] == "PENDING"
    assert elapsed < 5  # it returns: nothing claims the command, the wait just ends

    zero = await api.send("dev-1", {"name": "reboot"}, query="?wait=0")
    assert (zero.status, zero.body["command"]["status"]) == (201, "PENDING")
    # The wait also applies to a repeat of an earlier request.
    keyed = {"name": "reboot", "idempotency_key": "k"}
    assert (await api.send("dev-1", keyed)).status == 201
    repeat = await api.send("dev-1", keyed, query="?wait=0.1")
    assert (repeat.status, repeat.body["created"]) == (200, False)


async def test_wait_ends_when_another_request_cancels(api: Api) -> None:
    command = await api.create("dev-1", idempotency_key="k")
    waiting = asyncio.create_task(
        api.send("dev-1", {"name": "reboot", "idempotency_key": "k"}, query="?wait=30")
    )
    cancelled = await api.call("POST", f"/commands/{command['id']}/cancel")
    assert cancelled.status == 200
    async with asyncio.timeout(20):
        reply = await waiting
    assert reply.status == 200, reply.body
    assert reply.body["command"]["status"] == "CANCELLED"


async def test_stopping_the_service_ends_every_wait(api: Api) -> None:
    command = await api.create("dev-1")
    waiting = asyncio.create_task(api.service.wait_terminal(command["id"], 60))
    api.service.stop.set()
    async with asyncio.timeout(10):
        row = await waiting
    assert row.status == "PENDING"
    unknown = api.service.wait_terminal(4242, 1)
    with pytest.raises(CommandNotFoundError):
        await unknown


@pytest.mark.parametrize(
    ("behaviour", "expected"),
    [
        (Behaviour.FAIL_CODE, ("FAILED", "ACKED", 3, "E-17")),
        (Behaviour.SUCCESS, ("ACKED", "ACKED", 0, None)),
    ],
    ids=["failure", "success"],
)
async def test_realtime_outcome_reaches_the_waiting_post(
    db_dsn: str,
    db: asyncpg.Connection,
    mosquitto: Mosquitto,
    behaviour: Behaviour,
    expected: tuple[str, str, int, str | None],
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra="[commands]\nlease_s = 10\n")
    responder = Responder(
        host="127.0.0.1", port=mosquitto.port, topics=Topics("iot"),
        script=Script(default=behaviour),
    )  # fmt: skip
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop), name="responder")
    try:
        await responder.wait_subscribed()
        async with running_daemon(config), serve(db_dsn, db) as api:
            reply = await api.send(
                "dev-7", {"name": "reboot", "params": {"a": 1}}, query="?wait=20"
            )
            assert reply.status == 201, reply.body
            command = reply.body["command"]
            # In that one call: the device's answer, as the behaviour contract's table says.
            assert (command["status"], command["result"], command["result_code"],
                    command["raw_result_code"]) == expected  # fmt: skip
            assert command["finished_at"] is not None
            assert command["claim_generation"] == 1
            assert command["claimed_node_id"] == "test-node"

            detail = await api.command(command["id"])
            assert detail["command"] == command
            accepted = [r for r in detail["receipts"] if r["outcome"] == "accepted"]
            assert len(accepted) == 1, detail["receipts"]
            receipt = accepted[0]
            assert set(receipt) >= RECEIPT_FIELDS
            assert (receipt["result"], receipt["result_code"], receipt["raw_result_code"]) == (
                expected[1:]
            )
            assert (receipt["claim_generation"], receipt["node_id"], receipt["reason"]) == (
                1, "test-node", None,
            )  # fmt: skip
            if behaviour is Behaviour.FAIL_CODE:
                assert receipt["raw_ack"].startswith("NAK E-17")

            # A terminal command cannot be cancelled; nothing changes.
            before = await api.snapshot()
            refused = await api.call("POST", f"/commands/{command['id']}/cancel")
            assert (refused.status, refused.body["error"]) == (400, "ILLEGAL_TRANSITION")
            assert refused.body["current_status"] == expected[0]
            assert await api.snapshot() == before
    finally:
        stop.set()
        await answering


# --- the boundary: what the issue found (each of these failed on the aiohttp API) ------------


@pytest.mark.parametrize(
    "wait", ["21.00314514009938", "0.0016810373854295737", "1e1", "0.5e-3", "60", "0"]
)
async def test_every_documented_wait_is_accepted(api: Api, wait: str) -> None:
    """The document says a number from 0 to 60; any JSON spelling of one is taken. (The
    command is cancelled as soon as it exists, which ends the wait: no test waits a minute.)"""
    sent = asyncio.create_task(api.send("dev-1", {"name": "reboot"}, query=f"?wait={wait}"))

    async def created() -> bool:
        rows, _, _ = await api.snapshot()
        return bool(rows) or sent.done()

    await wait_until(created, timeout=30, message="the command created")
    rows, _, _ = await api.snapshot()
    if not sent.done():
        cancel = await api.call("POST", f"/commands/{rows[0]['id']}/cancel", token=OPERATOR)
        assert cancel.status == 200, cancel.body
    reply = await sent
    assert reply.status == 201, reply.body
    assert reply.body["command"]["status"] in {"PENDING", "CANCELLED"}


@pytest.mark.parametrize(
    "body",
    [
        {"name": "a", "idempotency_key": "k\x00"},
        {"name": "a", "params": {"k": {"deeper": ["\x00"]}}},
        {"name": "\x00"},
    ],
    ids=["nul-in-key", "nul-deep-in-params", "only-nul-name"],
)
async def test_nul_in_a_body_field_is_422_and_creates_nothing(api: Api, body: Any) -> None:
    reply = await api.send("dev-1", body)
    assert (reply.status, reply.body["error"]) == (422, "INVALID_BODY"), reply.body
    assert await api.snapshot() == ([], 0, 0)


async def test_huge_ids_and_limits_are_400_never_500(api: Api) -> None:
    for method, path in (
        ("GET", f"/commands/{'9' * 5000}"),
        ("POST", f"/commands/{'9' * 5000}/cancel"),
        ("GET", f"/devices/d/commands?limit={'9' * 5000}"),
        ("GET", f"/devices/d/commands?before={'9' * 5000}"),
    ):
        reply = await api.call(method, path, token=OPERATOR)
        assert (reply.status, reply.body["error"]) == (400, "BAD_REQUEST"), (path, reply.body)
