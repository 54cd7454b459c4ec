"""The operator alarm API over real HTTP (loopback) against real PostgreSQL (behaviour §5, §9, §14).

The expected outcomes below are written from the tables of docs/behaviour.md, not read from the
domain code, so the test is an independent oracle for the whitelist.
"""

from __future__ import annotations

import asyncio
import io
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiohttp
import asyncpg
import pytest
from litestar import Litestar
from structlog.testing import capture_logs

from gateway.alarms.lifecycle import create_alarm, transition
from gateway.alarms.service import AlarmService
from gateway.config import TokenConfig
from gateway.domain.alarm import Action
from storage.alarms import db_now
from tests.support.api_client import ADMIN, OPERATOR, VIEWER, ApiClient, Reply
from tests.support.api_server import FAKE_HEALTH_JSON, serve_api
from tests.support.held_batch import lock_waiters
from tests.support.waiting import wait_until

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
    # The race's operators, each their own token: the audit names the token, not the body.
    *(TokenConfig(token=f"race-operator-{n:04d}-0123456789", role="operator", name=f"op-{n}")
      for n in range(100)),
]  # fmt: skip
PEOPLE = ("confirm", "handle", "close", "false")
STEP = {"confirm": "confirmed", "handle": "handled", "close": "closed", "false": "false"}

# behaviour §5, the whitelist restricted to people's actions: {status: {action: new status}}.
WHITELIST: dict[str, dict[str, str]] = {
    "NEW": {"confirm": "CONFIRMED", "handle": "HANDLED", "false": "FALSE"},
    "PUSHED": {"confirm": "CONFIRMED", "handle": "HANDLED", "false": "FALSE"},
    "DELAYED": {"confirm": "CONFIRMED", "handle": "HANDLED"},
    "CONFIRMED": {"handle": "HANDLED", "false": "FALSE"},
    "ESCALATED": {"confirm": "CONFIRMED", "handle": "HANDLED", "false": "FALSE"},
    "HANDLED": {"close": "CLOSED"},
    "CLOSED": {},
    "FALSE": {},
    "SUPERSEDED": {},
}


def _listed(body: dict[str, Any]) -> dict[str, Any]:
    """An alarm body less ``ai_summary`` (null here: AI is off in these tests)."""
    assert body.get("ai_summary", "absent") is None
    return {k: v for k, v in body.items() if k != "ai_summary"}


@dataclass
class Api(ApiClient):
    app: Litestar
    db: asyncpg.Connection
    service: AlarmService

    async def act(
        self,
        alarm_id: int,
        action: str,
        actor: str = "alice",
        *,
        token: str | None = OPERATOR,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        return await self.call(
            "POST", f"/alarms/{alarm_id}/{action}", json={"actor": actor, "note": "n"},
            token=token, headers=headers,
        )  # fmt: skip

    async def alarm(self, alarm_id: int) -> dict[str, Any]:
        """The alarm as listed: GET /alarms/{id} less its ``ai_summary`` (only the detail
        carries it; AI is off in these tests, so it is null)."""
        reply = await self.get(f"/alarms/{alarm_id}")
        assert reply.status == 200, reply.body
        body: dict[str, Any] = reply.body
        assert body.pop("ai_summary") is None
        return body

    async def snapshot(self, alarm_id: int) -> tuple[dict[str, Any], int, int]:
        """The alarm as the API shows it, and how many audit rows and events it has."""
        audit = await self.db.fetchval(
            "SELECT count(*) FROM alarm_audit WHERE alarm_id = $1", alarm_id
        )
        events = await self.db.fetchval(
            "SELECT count(*) FROM outbox_event WHERE aggregate_type = 'alarm' "
            "AND aggregate_id = $1",
            str(alarm_id),
        )
        return await self.alarm(alarm_id), audit, events

    async def raise_alarm(self, device: str, rule: str = "r1", event: str | None = None) -> int:
        async with self.db.transaction():
            created = await create_alarm(
                self.db, device_id=device, rule_key=rule, severity="MAJOR",
                telemetry_event_id=event or uuid.uuid4().hex, reason="test", node_id="n",
                now=await db_now(self.db),
            )  # fmt: skip
        assert created.alarm is not None
        return created.alarm.id

    async def system(self, alarm_id: int, action: Action) -> None:
        async with self.db.transaction():
            await transition(self.db, alarm_id, action, actor="system:test", node_id="n")


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with (
        serve_api(db_dsn, TOKENS) as served,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200)) as http,
    ):
        yield Api(base=served.base, http=http, app=served.app, db=db, service=served.alarms)


# --- every people's action from every reachable state ------------------------------------------

# How to reach each state (several ways for some: which steps are recorded matters).
# "refire": the rule fires again for the same device, superseding the alarm if nobody attended.
RECIPES: dict[str, tuple[Sequence[str], str]] = {
    "new": ((), "NEW"),
    "new-after-delay": (("delay", "wake"), "NEW"),
    "pushed": (("push",), "PUSHED"),
    "delayed": (("delay",), "DELAYED"),
    "confirmed": (("confirm",), "CONFIRMED"),
    "confirmed-again-after-escalation": (("push", "confirm", "escalate", "confirm"), "CONFIRMED"),
    "escalated": (("confirm", "escalate"), "ESCALATED"),
    "handled-directly": (("handle",), "HANDLED"),
    "handled-after-confirm": (("push", "confirm", "handle"), "HANDLED"),
    "closed": (("handle", "close"), "CLOSED"),
    "closed-after-confirm": (("confirm", "handle", "close"), "CLOSED"),
    "false": (("false",), "FALSE"),
    "false-after-confirm": (("delay", "confirm", "false"), "FALSE"),
    "superseded-new": (("refire",), "SUPERSEDED"),
    "superseded-pushed": (("push", "refire"), "SUPERSEDED"),
    "superseded-delayed": (("delay", "refire"), "SUPERSEDED"),
}


async def build(api: Api, steps: Sequence[str], device: str) -> tuple[int, int | None]:
    """An alarm after ``steps``; and the alarm that superseded it, if one did."""
    alarm_id = await api.raise_alarm(device)
    successor = None
    for step in steps:
        if step == "refire":
            successor = await api.raise_alarm(device)
        elif step in PEOPLE:
            await api.service.act(alarm_id, Action(step), actor="bob")
        else:
            await api.system(alarm_id, Action(step))
    return alarm_id, successor


@pytest.mark.parametrize("action", PEOPLE)
@pytest.mark.parametrize("recipe", list(RECIPES))
async def test_every_action_from_every_state(api: Api, recipe: str, action: str) -> None:
    steps, status = RECIPES[recipe]
    alarm_id, successor = await build(api, steps, device=f"dev-{recipe}")
    before, audit_before, events_before = await api.snapshot(alarm_id)
    assert before["status"] == status

    allowed = await api.get(f"/alarms/{alarm_id}/actions")
    assert allowed.status == 200
    assert allowed.body["status"] == status
    assert allowed.body["actions"] == [a for a in PEOPLE if a in WHITELIST[status]]

    reply = await api.act(alarm_id, action, actor="carol", headers={"X-Request-Id": "req-42"})
    assert reply.headers["X-Request-Id"] == "req-42"
    after, audit_after, events_after = await api.snapshot(alarm_id)

    if action in WHITELIST[status]:
        assert reply.status == 200, reply.body
        assert _listed(reply.body) == after
        assert after["status"] == WHITELIST[status][action]
        # The token's name acted; the body's "carol" is kept apart, untrusted.
        assert after[f"{STEP[action]}_by"] == "console"
        assert (audit_after, events_after) == (audit_before + 1, events_before + 1)
        trail = (await api.get(f"/alarms/{alarm_id}/audit")).body["items"]
        assert (trail[-1]["actor"], trail[-1]["stated_actor"]) == ("console", "carol")
        assert trail[-1]["action"] == action
        assert (trail[-1]["from_status"], trail[-1]["to_status"]) == (status, after["status"])
        assert trail[-1]["request_id"] == "req-42"
        assert trail[-1]["note"] == "n"
        return

    # Refused: the right code, and nothing changed at all.
    assert (after, audit_after, events_after) == (before, audit_before, events_before)
    assert reply.body["message"]
    if status == "SUPERSEDED":
        assert reply.status == 400
        assert reply.body["error"] == "ALARM_SUPERSEDED"
        assert reply.body["superseded_by"] == successor
    elif before[f"{STEP[action]}_by"] is not None:
        # The step was taken already: for the caller that is losing a race (behaviour §5).
        assert reply.status == 409
        assert reply.body["error"] == "STATUS_CHANGED"
        assert reply.body["current_status"] == status
        assert reply.body["actor"] == "bob"
        assert f"already {STEP[action]} by bob" in reply.body["message"]
    else:
        assert reply.status == 400
        assert reply.body["error"] == "ILLEGAL_TRANSITION"
        assert reply.body["current_status"] == status
        assert reply.body["allowed"] == allowed.body["actions"]


# --- supersede chains ---------------------------------------------------------------------------


async def test_the_spec_chain_example(api: Api) -> None:
    a1 = await api.raise_alarm("door-7", "door_open", "e1")
    a2 = await api.raise_alarm("door-7", "door_open", "e2")
    a3 = await api.raise_alarm("door-7", "door_open", "e3")
    assert (await api.act(a3, "handle")).status == 200
    a4 = await api.raise_alarm("door-7", "door_open", "e4")  # 3 is HANDLED: only the key moves
    a5 = await api.raise_alarm("door-7", "door_open", "e5")

    statuses = {i: (await api.alarm(i))["status"] for i in (a1, a2, a3, a4, a5)}
    assert statuses == {
        a1: "SUPERSEDED", a2: "SUPERSEDED", a3: "HANDLED", a4: "SUPERSEDED", a5: "NEW",
    }  # fmt: skip

    async def chain(alarm_id: int) -> dict[str, Any]:
        reply = await api.get(f"/alarms/{alarm_id}/chain")
        assert reply.status == 200
        body: dict[str, Any] = reply.body
        return body

    five = await chain(a5)
    assert [a["id"] for a in five["items"]] == [a4, a5]
    assert five["hint"] is None
    assert five["items"][-1] == await api.alarm(a5)
    three = await chain(a3)
    assert [a["id"] for a in three["items"]] == [a1, a2, a3]
    assert three["hint"] is None
    two = await chain(a2)
    assert [a["id"] for a in two["items"]] == [a2]
    assert two["hint"] == f"superseded by {a3}, cannot be handled on its own"
    assert two["superseded_by"] == a3
    one = await chain(a1)
    assert ([a["id"] for a in one["items"]], one["superseded_by"]) == ([a1], a2)

    actions = await api.get(f"/alarms/{a2}/actions")
    assert actions.body == {"status": "SUPERSEDED", "actions": [], "superseded_by": a3}
    before = await api.snapshot(a2)
    for action in PEOPLE:
        reply = await api.act(a2, action, token=ADMIN)
        assert reply.status == 400
        assert reply.body["error"] == "ALARM_SUPERSEDED"
        assert reply.body["superseded_by"] == a3
    assert await api.snapshot(a2) == before


# --- concurrency --------------------------------------------------------------------------------


async def test_one_hundred_concurrent_confirms_have_exactly_one_winner(api: Api) -> None:
    alarm_id = await api.raise_alarm("race")
    await api.system(alarm_id, Action.PUSH)
    _, audit_before, events_before = await api.snapshot(alarm_id)
    n_operators = 100
    waiting = 0
    all_waiting, gate = asyncio.Event(), asyncio.Event()

    async def operator(n: int) -> tuple[str, Reply]:
        nonlocal waiting
        waiting += 1
        if waiting == n_operators:
            all_waiting.set()
        await gate.wait()
        return f"op-{n}", await api.act(
            alarm_id, "confirm", token=f"race-operator-{n:04d}-0123456789"
        )

    tasks = [asyncio.create_task(operator(n)) for n in range(n_operators)]
    await all_waiting.wait()
    gate.set()
    results = await asyncio.gather(*tasks)

    winners = [(actor, r) for actor, r in results if r.status == 200]
    losers = [r for _, r in results if r.status != 200]
    assert len(winners) == 1
    assert len(losers) == 99
    winner, won = winners[0]
    assert won.body["confirmed_by"] == winner
    for reply in losers:
        assert reply.status == 409
        assert reply.body["error"] == "STATUS_CHANGED"
        assert reply.body["current_status"] == "CONFIRMED"
        assert reply.body["actor"] == winner
        assert f"already confirmed by {winner}" in reply.body["message"]
    stored, audit_after, events_after = await api.snapshot(alarm_id)
    assert (stored["status"], stored["confirmed_by"]) == ("CONFIRMED", winner)
    assert (audit_after, events_after) == (audit_before + 1, events_before + 1)


async def test_handling_a_confirmed_alarm_while_its_rule_fires_again_is_200_and_keeps_the_refire(
    api: Api, db_dsn: str
) -> None:
    """The rule fires again while a person handles the alarm they confirmed: the refire's
    transaction releases the confirmed alarm's active key (its status stays) and gives it to
    the new alarm, and is still open while the handle reads the alarm. The handle waits for
    it and then writes the alarm as the refire left it: 200 HANDLED, the key stays released
    and the new alarm keeps it (never the old key written back: a unique violation, a 500)."""
    alarm_id = await api.raise_alarm("refire")
    assert (await api.act(alarm_id, "confirm")).status == 200
    ingest = await asyncpg.connect(db_dsn)
    try:
        refire = ingest.transaction()
        await refire.start()
        created = await create_alarm(
            ingest, device_id="refire", rule_key="r1", severity="MAJOR",
            telemetry_event_id=uuid.uuid4().hex, reason="refire", node_id="ingest",
            now=await db_now(ingest),
        )  # fmt: skip
        assert created.alarm is not None
        handling = asyncio.create_task(api.act(alarm_id, "handle"))
        await wait_until(lambda: lock_waiters(db_dsn), message="the handle waits for the refire")
        assert not handling.done()
        await refire.commit()
        reply = await handling
    finally:
        await ingest.close()
    assert reply.status == 200, reply.body
    assert (reply.body["status"], reply.body["handled_by"]) == ("HANDLED", "console")
    keys = dict(await api.db.fetch("SELECT id, active_key FROM alarm WHERE device_id = 'refire'"))
    assert keys == {alarm_id: None, created.alarm.id: "refire:r1"}


# --- authentication -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token-0123456789abcdef", "Bearer ", f"Basic {OPERATOR}", OPERATOR],
    ids=["missing", "unknown", "empty", "basic-scheme", "no-scheme"],
)
async def test_unauthenticated_requests_get_401_and_change_nothing(
    api: Api, authorization: str | None
) -> None:
    alarm_id = await api.raise_alarm("auth")
    before = await api.snapshot(alarm_id)
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path, body in [
        ("GET", "/alarms", None),
        ("GET", f"/alarms/{alarm_id}", None),
        ("GET", f"/alarms/{alarm_id}/audit", None),
        ("POST", f"/alarms/{alarm_id}/confirm", {"actor": "mallory"}),
    ]:
        reply = await api.call(method, path, token=None, json=body, headers=headers)
        assert reply.status == 401, (method, path)
        assert reply.body["error"] == "UNAUTHORIZED"
        assert reply.body["message"]
        assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    assert await api.snapshot(alarm_id) == before


async def test_roles(api: Api) -> None:
    alarm_id = await api.raise_alarm("roles")
    before = await api.snapshot(alarm_id)
    for action in PEOPLE:
        reply = await api.act(alarm_id, action, token=VIEWER)
        assert reply.status == 403
        assert reply.body["error"] == "FORBIDDEN"
        assert reply.body["required_role"] == "operator"
    assert await api.snapshot(alarm_id) == before

    for token in (VIEWER, OPERATOR, ADMIN):
        for path in ("", "/actions", "/chain", "/audit"):
            assert (await api.get(f"/alarms/{alarm_id}{path}", token=token)).status == 200
        assert (await api.get("/alarms", token=token)).status == 200
    assert (await api.act(alarm_id, "confirm", token=OPERATOR)).status == 200
    assert (await api.act(alarm_id, "handle", token=ADMIN)).status == 200


async def test_service_endpoints_need_no_token(api: Api) -> None:
    health = await api.call("GET", "/health", token=None)
    assert (health.status, health.body) == (200, FAKE_HEALTH_JSON)
    async with api.http.get(f"{api.base}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
    assert (await api.call("GET", "/openapi.json", token=None)).status == 200


# --- request ids --------------------------------------------------------------------------------


async def test_request_id_is_generated_echoed_and_audited(api: Api) -> None:
    alarm_id = await api.raise_alarm("rid")
    reply = await api.act(alarm_id, "confirm")
    assert reply.status == 200
    generated = reply.headers["X-Request-Id"]
    assert uuid.UUID(generated)
    trail = (await api.get(f"/alarms/{alarm_id}/audit")).body["items"]
    assert trail[-1]["request_id"] == generated
    for entry in trail:
        assert datetime.fromisoformat(entry["at"]).utcoffset() is not None

    refused = await api.act(alarm_id, "close", headers={"X-Request-Id": "refused-1"})
    assert (refused.status, refused.headers["X-Request-Id"]) == (400, "refused-1")

    for bad in ("has space", "x" * 129):
        before = await api.snapshot(alarm_id)
        reply = await api.act(alarm_id, "handle", headers={"X-Request-Id": bad})
        assert reply.status == 400
        assert (reply.body["error"], reply.body["param"]) == ("BAD_REQUEST", "X-Request-Id")
        assert await api.snapshot(alarm_id) == before


# --- bad input ----------------------------------------------------------------------------------

BAD_BODIES = {
    "malformed": b"{nope",
    "empty": b"",
    "trailing-garbage": b'{"actor": "a"} x',
    "not-utf8": b'{"actor": "\xff"}',
    "array": b"[]",
    "null": b"null",
    "string": b'"alice"',
    "unknown-field": b'{"actor": "alice", "role": "admin"}',
    "empty-actor": b'{"actor": ""}',
    "blank-actor": b'{"actor": "   "}',
    "actor-not-string": b'{"actor": 7}',
    "actor-too-long": b'{"actor": "' + b"a" * 129 + b'"}',
    "note-too-long": b'{"actor": "alice", "note": "' + b"n" * 2001 + b'"}',
    "note-not-string": b'{"actor": "alice", "note": 5}',
    "system-actor": b'{"actor": "system:rules"}',
}


@pytest.mark.parametrize("raw", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_bad_bodies_are_422_and_change_nothing(api: Api, raw: bytes) -> None:
    alarm_id = await api.raise_alarm("body")
    before = await api.snapshot(alarm_id)
    reply = await api.call(
        "POST", f"/alarms/{alarm_id}/confirm", token=OPERATOR, data=raw,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    assert reply.status == 422, reply.body
    assert reply.body["error"] == "INVALID_BODY"
    assert reply.body["message"]
    assert reply.body["detail"]
    assert await api.snapshot(alarm_id) == before


async def test_bodies_at_the_limits_are_accepted(api: Api) -> None:
    alarm_id = await api.raise_alarm("limits")
    reply = await api.call(
        "POST", f"/alarms/{alarm_id}/confirm", token=OPERATOR,
        json={"actor": "a" * 128, "note": "n" * 2000},
    )  # fmt: skip
    assert reply.status == 200
    assert reply.body["confirmed_by"] == "console"
    reply = await api.call("POST", f"/alarms/{alarm_id}/handle", token=OPERATOR, json={})
    assert (reply.status, reply.body["handled_by"]) == (200, "console")
    trail = (await api.get(f"/alarms/{alarm_id}/audit")).body["items"]
    assert [(t["actor"], t["stated_actor"]) for t in trail[-2:]] == [
        ("console", "a" * 128),
        ("console", None),
    ]


async def test_a_huge_body_is_413(api: Api) -> None:
    alarm_id = await api.raise_alarm("huge")
    before = await api.snapshot(alarm_id)
    reply = await api.call(
        "POST", f"/alarms/{alarm_id}/confirm", token=OPERATOR,
        data=io.BytesIO(b'{"actor": "' + b"a" * (2 * 1024 * 1024) + b'"}'),
    )  # fmt: skip
    assert (reply.status, reply.body["error"]) == (413, "PAYLOAD_TOO_LARGE")
    assert await api.snapshot(alarm_id) == before


BAD_QUERIES = {
    "status=BOGUS": "status",
    "status=new": "status",
    "status=NEW&status=": "status",
    "limit=0": "limit",
    "limit=501": "limit",
    "limit=-1": "limit",
    "limit=abc": "limit",
    "limit=1.5": "limit",
    "limit=10&limit=20": "limit",
    "before=abc": "before",
    "before=0": "before",
    "before=99999999999999999999": "before",
    "open=maybe": "open",
    "device=": "device",
    "device=a&device=b": "device",
    "rule=" + "r" * 257: "rule",
    "statuses=NEW": "statuses",
}


@pytest.mark.parametrize(("query", "param"), BAD_QUERIES.items(), ids=BAD_QUERIES.keys())
async def test_bad_query_parameters_are_400(api: Api, query: str, param: str) -> None:
    reply = await api.get(f"/alarms?{query}")
    assert reply.status == 400, reply.body
    assert (reply.body["error"], reply.body["param"]) == ("BAD_REQUEST", param)
    assert param in reply.body["message"]


BAD_IDS = ("abc", "1.5", "-1", "0", "1e3", "99999999999999999999", "%C2%B2")


@pytest.mark.parametrize("bad_id", BAD_IDS)
async def test_bad_ids_are_400_never_500(api: Api, bad_id: str) -> None:
    for suffix in ("", "/actions", "/chain", "/audit"):
        reply = await api.get(f"/alarms/{bad_id}{suffix}")
        assert reply.status == 400, (suffix, reply.body)
        assert (reply.body["error"], reply.body["param"]) == ("BAD_REQUEST", "id")
    reply = await api.act(bad_id, "confirm")  # type: ignore[arg-type]  # a bad id on purpose
    assert (reply.status, reply.body["param"]) == (400, "id")


async def test_unknown_ids_and_paths_are_404(api: Api) -> None:
    for suffix in ("", "/actions", "/chain", "/audit"):
        reply = await api.get(f"/alarms/424242{suffix}")
        assert reply.status == 404
        assert (reply.body["error"], reply.body["alarm_id"]) == ("NOT_FOUND", 424242)
    reply = await api.act(424242, "confirm")
    assert (reply.status, reply.body["error"]) == (404, "NOT_FOUND")

    alarm_id = await api.raise_alarm("paths")
    before = await api.snapshot(alarm_id)
    for action in ("destroy", "push", "escalate", "supersede", "CONFIRM"):
        reply = await api.act(alarm_id, action)
        assert (reply.status, reply.body["error"]) == (404, "NOT_FOUND"), action
        assert reply.body["message"]
    reply = await api.get(f"/alarms/{alarm_id}/confirm")
    assert (reply.status, reply.body["error"]) == (405, "METHOD_NOT_ALLOWED")
    assert "POST" in reply.headers["Allow"]
    reply = await api.get("/nowhere", token=None)
    assert (reply.status, reply.body["error"]) == (404, "NOT_FOUND")
    assert await api.snapshot(alarm_id) == before


# --- listing ------------------------------------------------------------------------------------


async def test_keyset_pagination_across_three_pages(api: Api) -> None:
    ids = [await api.raise_alarm(f"page-{n}") for n in range(7)]
    seen: list[int] = []
    cursor = ""
    pages = []
    while True:
        reply = await api.get(f"/alarms?limit=3{cursor}")
        assert reply.status == 200
        pages.append(len(reply.body["items"]))
        seen += [a["id"] for a in reply.body["items"]]
        if reply.body["next_before"] is None:
            break
        assert reply.body["next_before"] == seen[-1]
        cursor = f"&before={reply.body['next_before']}"
    assert pages == [3, 3, 1]
    assert seen == sorted(ids, reverse=True)

    exact = await api.get("/alarms?limit=7")
    assert (len(exact.body["items"]), exact.body["next_before"]) == (7, None)
    default = await api.get("/alarms")
    assert [a["id"] for a in default.body["items"]] == seen
    assert default.body["items"][0] == await api.alarm(seen[0])


async def test_filters(api: Api) -> None:
    new_d1_r1 = await api.raise_alarm("d1", "r1")
    pushed_d1_r2 = await api.raise_alarm("d1", "r2")
    await api.system(pushed_d1_r2, Action.PUSH)
    handled_d2_r1 = await api.raise_alarm("d2", "r1")
    await api.service.act(handled_d2_r1, Action.HANDLE, actor="bob")
    closed_d2_r2 = await api.raise_alarm("d2", "r2")
    await api.service.act(closed_d2_r2, Action.HANDLE, actor="bob")
    await api.service.act(closed_d2_r2, Action.CLOSE, actor="bob")
    confirmed_d3_r1 = await api.raise_alarm("d3", "r1")
    await api.service.act(confirmed_d3_r1, Action.CONFIRM, actor="bob")

    async def ids(query: str) -> list[int]:
        reply = await api.get(f"/alarms?{query}")
        assert reply.status == 200, reply.body
        return [a["id"] for a in reply.body["items"]]

    assert await ids("device=d1") == [pushed_d1_r2, new_d1_r1]
    assert await ids("rule=r1") == [confirmed_d3_r1, handled_d2_r1, new_d1_r1]
    assert await ids("status=NEW") == [new_d1_r1]
    assert await ids("status=NEW&status=PUSHED") == [pushed_d1_r2, new_d1_r1]
    assert await ids("open=true") == [confirmed_d3_r1, pushed_d1_r2, new_d1_r1]
    assert await ids("open=false") == await ids("")
    assert await ids("open=1&rule=r1") == [confirmed_d3_r1, new_d1_r1]
    assert await ids("device=d2&status=CLOSED&status=HANDLED") == [closed_d2_r2, handled_d2_r1]
    assert await ids("device=d2&open=true") == []
    assert await ids("device=nobody") == []
    assert await ids(f"rule=r1&before={handled_d2_r1}") == [new_d1_r1]


# --- faults -------------------------------------------------------------------------------------


async def test_a_failing_audit_write_rolls_the_action_back(api: Api) -> None:
    alarm_id = await api.raise_alarm("audit")
    await api.db.execute(
        """
        CREATE FUNCTION refuse_audit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'audit storage refused the row'; END $$;
        CREATE TRIGGER refuse_audit BEFORE INSERT ON alarm_audit
            FOR EACH ROW EXECUTE FUNCTION refuse_audit();
        """
    )
    before = await api.snapshot(alarm_id)
    with capture_logs() as logs:
        reply = await api.act(alarm_id, "confirm")
    assert reply.status == 500
    assert reply.body["error"] == "AUDIT_FAILED"  # a known fault, named: not INTERNAL
    assert "rolled back" in reply.body["message"]
    assert "refused the row" not in reply.body["message"]  # internals stay in the log
    assert reply.headers["X-Request-Id"]
    assert any(e["event"] == "api_audit_failed" and e["log_level"] == "error" for e in logs)
    assert not any(e["event"] == "api_error" for e in logs)  # no traceback for it
    assert await api.snapshot(alarm_id) == before

    await api.db.execute("DROP TRIGGER refuse_audit ON alarm_audit")
    assert (await api.act(alarm_id, "confirm")).status == 200


# --- the boundary: what the issue found (each of these failed on the aiohttp API) ------------


@pytest.mark.parametrize(
    "query", ["device=d%001", "rule=r%00", "limit=" + "9" * 5000, "before=" + "1" * 5000]
)
async def test_nul_and_huge_numbers_in_the_query_are_400_never_500(api: Api, query: str) -> None:
    reply = await api.get(f"/alarms?{query}")
    assert reply.status == 400, reply.body
    assert reply.body["error"] == "BAD_REQUEST"
    assert reply.body["param"] == query.partition("=")[0]


async def test_a_5000_digit_id_is_400_never_500(api: Api) -> None:
    for suffix in ("", "/actions", "/audit"):
        reply = await api.get(f"/alarms/{'7' * 5000}{suffix}")
        assert (reply.status, reply.body["param"]) == (400, "id"), reply.body
    reply = await api.act("8" * 5000, "confirm")  # type: ignore[arg-type]  # a bad id on purpose
    assert (reply.status, reply.body["param"]) == (400, "id")


@pytest.mark.parametrize(
    "body",
    [{"actor": "alice", "note": "a\x00b"}, {"actor": "al\x00ice"}, {"actor": "\x00"}],
    ids=["nul-in-note", "nul-in-actor", "only-nul"],
)
async def test_nul_in_a_body_field_is_422_and_changes_nothing(api: Api, body: Any) -> None:
    alarm_id = await api.raise_alarm("nul")
    before = await api.snapshot(alarm_id)
    reply = await api.call("POST", f"/alarms/{alarm_id}/confirm", token=OPERATOR, json=body)
    assert (reply.status, reply.body["error"]) == (422, "INVALID_BODY"), reply.body
    assert await api.snapshot(alarm_id) == before


async def test_the_documented_actor_pattern_is_what_the_server_accepts(api: Api) -> None:
    """`system:rules` was schema-valid and refused (422): now the document says so too."""
    document = (await api.call("GET", "/openapi.json", token=None)).body
    actor = document["components"]["schemas"]["ActionBody"]["properties"]["actor"]
    assert "actor" not in document["components"]["schemas"]["ActionBody"]["required"]
    pattern = re.compile(actor["pattern"])
    alarm_id = await api.raise_alarm("actor")
    for name in ("system:rules", "   ", "\u2003", "system:x"):
        assert pattern.search(name) is None, name
        reply = await api.act(alarm_id, "confirm", actor=name)
        assert (reply.status, reply.body["error"]) == (422, "INVALID_BODY"), name
    for name in ("System:rules", " bob", "system", "x system:"):
        assert pattern.search(name) is not None, name
    assert (await api.act(alarm_id, "confirm", actor="system")).status == 200


async def test_the_audit_names_the_token_not_the_body(db_dsn: str, db: asyncpg.Connection) -> None:
    """An operator token named "olga" confirms saying it is "mallory": the alarm, the audit
    and the event name olga; "mallory" is kept apart as the stated actor."""
    olga = "olga-operator-token-0123456789"
    tokens = [TokenConfig(token=olga, role="operator", name="olga")]
    async with serve_api(db_dsn, tokens) as served, aiohttp.ClientSession() as http:
        api = Api(base=served.base, http=http, app=served.app, db=db, service=served.alarms)
        alarm_id = await api.raise_alarm("olga")
        reply = await api.act(alarm_id, "confirm", actor="mallory", token=olga)
        assert (reply.status, reply.body["confirmed_by"]) == (200, "olga")
        trail = (await api.get(f"/alarms/{alarm_id}/audit", token=olga)).body["items"]
        assert (trail[-1]["actor"], trail[-1]["stated_actor"]) == ("olga", "mallory")
        rows = await db.fetch(
            "SELECT actor, stated_actor FROM alarm_audit WHERE alarm_id = $1 AND action = $2",
            alarm_id,
            "confirm",
        )
        assert [tuple(r) for r in rows] == [("olga", "mallory")]
        payload = await db.fetchval(
            "SELECT payload::text FROM outbox_event WHERE aggregate_id = $1 "
            "AND event_type = 'alarm.status_changed'",
            str(alarm_id),
        )
        assert '"actor": "olga"' in payload
        assert "mallory" not in payload
        assert (await api.get("/me", token=olga)).body == {"name": "olga", "role": "operator"}
