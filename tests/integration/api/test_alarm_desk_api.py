"""The alarm desk over real HTTP against real PostgreSQL (docs/api.md, "The alarm desk"):
states people can read, filters, counts, groups, bulk actions, shelves, out of service; 4xx
with an error code for everything refused, and a refused change changes nothing."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import asyncpg
import pytest

from gateway.alarms.lifecycle import clear_alarm, create_alarm
from gateway.config import TokenConfig
from storage.alarms import db_now
from tests.support.api_client import ADMIN, OPERATOR, VIEWER, ApiClient, Reply
from tests.support.api_server import serve_api

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]


@dataclass
class Api(ApiClient):
    db: asyncpg.Connection

    async def post(self, path: str, body: Any, *, token: str = OPERATOR) -> Reply:
        return await self.call("POST", path, json=body, token=token)

    async def raise_alarm(self, device: str, rule: str = "hot", severity: str = "MAJOR") -> int:
        async with self.db.transaction():
            created = await create_alarm(
                self.db, device_id=device, rule_key=rule, severity=severity,
                telemetry_event_id=uuid.uuid4().hex, reason="test", node_id="n",
                now=await db_now(self.db),
            )  # fmt: skip
        assert created.alarm is not None
        return created.alarm.id

    async def clear(self, device: str, rule: str = "hot") -> None:
        async with self.db.transaction():
            await clear_alarm(
                self.db, device_id=device, rule_key=rule, clear_event_id=uuid.uuid4().hex,
                reason="normal", now=await db_now(self.db),
            )  # fmt: skip

    async def ids(self, query: str) -> list[int]:
        reply = await self.get(f"/alarms?{query}")
        assert reply.status == 200, reply.body
        return [item["id"] for item in reply.body["items"]]

    async def audit_count(self) -> int:
        return int(await self.db.fetchval("SELECT count(*) FROM alarm_audit"))


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db)


async def test_every_alarm_says_active_or_returned_and_acknowledged_and_filters_follow(
    api: Api,
) -> None:
    live = await api.raise_alarm("d1")
    back = await api.raise_alarm("d2")
    await api.clear("d2")
    taken = await api.raise_alarm("d3")
    await api.clear("d3")
    assert (await api.post(f"/alarms/{taken}/confirm", {})).status == 200

    one = (await api.get(f"/alarms/{back}")).body
    assert (one["active"], one["acknowledged"], one["shelved_until"], one["out_of_service"]) == (
        False, False, None, False,
    )  # fmt: skip
    listed = {a["id"]: a for a in (await api.get("/alarms")).body["items"]}
    assert (listed[live]["active"], listed[live]["acknowledged"]) == (True, False)
    assert (listed[taken]["active"], listed[taken]["acknowledged"]) == (False, True)

    assert await api.ids("active=true") == [live]
    assert await api.ids("active=false") == [taken, back]
    assert await api.ids("cleared=true&acknowledged=false") == [back]
    assert await api.ids("cleared=false&open=true") == [live]
    assert await api.ids("severity=MAJOR&acknowledged=true") == [taken]
    for bad in ("active=maybe", "shelved=sometimes", "severity=HUGE", "acknowledged=null"):
        reply = await api.get(f"/alarms?{bad}")
        assert (reply.status, reply.body["error"]) == (400, "BAD_REQUEST"), bad


async def test_counts_per_severity_and_state(api: Api) -> None:
    await api.raise_alarm("d1", severity="CRITICAL")
    await api.raise_alarm("d2", severity="CRITICAL")
    await api.clear("d2")
    shelved = await api.raise_alarm("d3", severity="INFO")
    reply = await api.post(f"/alarms/{shelved}/shelve", {"duration_s": 600, "reason": "known"})
    assert reply.status == 201, reply.body
    counts = await api.get("/alarms/counts")
    assert counts.status == 200, counts.body
    body = counts.body
    assert set(body["by_severity"]) == {"INFO", "WARNING", "MAJOR", "CRITICAL"}
    critical = body["by_severity"]["CRITICAL"]
    assert (critical["total"], critical["active_unacknowledged"],
            critical["returned_unacknowledged"], critical["shelved"]) == (2, 1, 1, 0)  # fmt: skip
    assert body["by_severity"]["INFO"]["shelved"] == 1
    assert body["by_severity"]["MAJOR"]["total"] == 0
    assert (body["all"]["total"], body["all"]["shelved"]) == (3, 1)


async def test_groups_by_rule_then_a_groups_alarms_through_the_list(api: Api) -> None:
    await api.raise_alarm("a", "hot", "WARNING")
    newest = await api.raise_alarm("b", "hot", "CRITICAL")
    await api.raise_alarm("a", "cold", "INFO")
    reply = await api.get("/alarms/groups?by=rule&open=true")
    assert reply.status == 200, reply.body
    assert reply.body["by"] == "rule"
    assert [(g["key"], g["count"], g["newest_id"], g["worst_severity"])
            for g in reply.body["items"]] == [
        ("hot", 2, newest, "CRITICAL"), ("cold", 1, newest + 1, "INFO"),
    ]  # fmt: skip
    devices = (await api.get("/alarms/groups?by=device")).body["items"]
    assert {g["key"]: g["count"] for g in devices} == {"a": 2, "b": 1}
    assert await api.ids("rule=hot&open=true") == [newest, newest - 1]
    assert (await api.get("/alarms/groups")).body["by"] == "rule"
    wrong = await api.get("/alarms/groups?by=site")
    assert (wrong.status, wrong.body["error"]) == (400, "BAD_REQUEST")


async def test_bulk_confirm_gives_a_result_per_alarm_and_one_refused_stops_nothing(
    api: Api,
) -> None:
    first = await api.raise_alarm("d1")
    handled = await api.raise_alarm("d2")
    assert (await api.post(f"/alarms/{handled}/handle", {})).status == 200
    third = await api.raise_alarm("d3")
    before = await api.audit_count()
    reply = await api.post(
        "/alarms/bulk",
        {"action": "confirm", "ids": [first, handled, third], "note": "storm", "actor": "al"},
    )
    assert reply.status == 200, reply.body
    body = reply.body
    assert (body["action"], body["done"], body["refused"]) == ("confirm", 2, 1)
    items = {i["alarm_id"]: i for i in body["items"]}
    assert items[first] == {"alarm_id": first, "ok": True, "status": "CONFIRMED"}
    assert items[third]["status"] == "CONFIRMED"
    assert items[handled]["ok"] is False
    assert (items[handled]["error"], items[handled]["current_status"]) == (
        "ILLEGAL_TRANSITION", "HANDLED",
    )  # fmt: skip
    assert await api.audit_count() == before + 2
    trail = (await api.get(f"/alarms/{first}/audit")).body["items"]
    assert (trail[-1]["actor"], trail[-1]["stated_actor"], trail[-1]["note"]) == (
        "console", "al", "storm",
    )  # fmt: skip


def _results(reply: Reply) -> list[tuple[int, bool, str | None]]:
    """Each item's alarm, whether it was acted on, and its status or error code."""
    assert reply.status == 200, reply.body
    return [
        (i["alarm_id"], i["ok"], i.get("status") or i.get("error")) for i in reply.body["items"]
    ]


async def test_a_bulk_alarm_whose_audit_row_is_refused_is_its_own_item_and_the_rest_are_acted_on(
    api: Api,
) -> None:
    first, second, third = [await api.raise_alarm(f"d{n}") for n in range(3)]
    await api.db.execute(  # the audit storage refuses the second alarm's row only
        f"ALTER TABLE alarm_audit ADD CONSTRAINT test_refuses CHECK (alarm_id <> {second}) "
        "NOT VALID"
    )
    reply = await api.post("/alarms/bulk", {"action": "confirm", "ids": [first, second, third]})
    assert _results(reply) == [
        (first, True, "CONFIRMED"), (second, False, "AUDIT_FAILED"), (third, True, "CONFIRMED"),
    ]  # fmt: skip
    assert (reply.body["done"], reply.body["refused"]) == (2, 1)
    statuses = [(await api.get(f"/alarms/{a}")).body["status"] for a in (first, second, third)]
    assert statuses == ["CONFIRMED", "NEW", "CONFIRMED"]


async def test_a_bulk_action_stops_where_the_database_went_away_and_says_so_for_each_alarm(
    api: Api,
) -> None:
    first, second, third = [await api.raise_alarm(f"d{n}") for n in range(3)]
    # The second alarm's update ends its own connection, as a server going down would.
    await api.db.execute(
        "CREATE FUNCTION test_cut() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NEW; END $$"
    )
    await api.db.execute(
        "CREATE TRIGGER test_cut BEFORE UPDATE ON alarm FOR EACH ROW "
        f"WHEN (OLD.id = {second}) EXECUTE FUNCTION test_cut()"
    )
    reply = await api.post("/alarms/bulk", {"action": "confirm", "ids": [first, second, third]})
    assert _results(reply) == [
        (first, True, "CONFIRMED"), (second, False, "UNAVAILABLE"), (third, False, "NOT_ATTEMPTED"),
    ]  # fmt: skip
    assert (reply.body["done"], reply.body["refused"]) == (1, 2)
    statuses = [(await api.get(f"/alarms/{a}")).body["status"] for a in (first, second, third)]
    assert statuses == ["CONFIRMED", "NEW", "NEW"]


async def test_bulk_over_a_group_acts_on_the_groups_alarms_only(api: Api) -> None:
    hot = [await api.raise_alarm(f"d{n}", "hot") for n in range(3)]
    cold = await api.raise_alarm("d9", "cold")
    reply = await api.post(
        "/alarms/bulk",
        {"action": "false", "group": {"by": "rule", "key": "hot", "filters": {"open": True}}},
    )
    assert reply.status == 200, reply.body
    assert sorted(i["alarm_id"] for i in reply.body["items"]) == hot
    assert reply.body["done"] == 3
    assert (await api.get(f"/alarms/{cold}")).body["status"] == "NEW"


async def test_bulk_refusals_change_nothing(api: Api) -> None:
    alarm_id = await api.raise_alarm("d1")
    before = await api.audit_count()
    too_many = await api.post("/alarms/bulk", {"action": "confirm", "ids": list(range(1, 502))})
    assert (too_many.status, too_many.body["error"], too_many.body["limit"]) == (
        400, "TOO_MANY_ALARMS", 500,
    )  # fmt: skip
    for body in (
        {"action": "handle", "ids": [alarm_id]},  # not a bulk action
        {"action": "confirm"},  # neither ids nor group
        {"action": "confirm", "ids": [alarm_id], "group": {"by": "rule", "key": "hot"}},
        {"action": "confirm", "ids": None},
        {"action": "confirm", "ids": []},
        {"action": "confirm", "ids": [0]},
    ):
        reply = await api.post("/alarms/bulk", body)
        assert (reply.status, reply.body["error"]) == (422, "INVALID_BODY"), body
    viewer = await api.post("/alarms/bulk", {"action": "confirm", "ids": [alarm_id]}, token=VIEWER)
    assert (viewer.status, viewer.body["error"]) == (403, "FORBIDDEN")
    assert await api.audit_count() == before
    assert (await api.get(f"/alarms/{alarm_id}")).body["status"] == "NEW"


async def test_shelve_lift_and_the_default_view(api: Api) -> None:
    alarm_id = await api.raise_alarm("pump")
    other = await api.raise_alarm("fan")
    reply = await api.post(
        f"/alarms/{alarm_id}/shelve", {"scope": "pair", "duration_s": 600, "reason": "work"}
    )
    assert reply.status == 201, reply.body
    shelf = reply.body
    assert (shelf["scope"], shelf["device_id"], shelf["rule_key"], shelf["shelved_by"]) == (
        "pair", "pump", "hot", "console",
    )  # fmt: skip
    assert shelf["alarm_id"] is None
    assert await api.ids("") == [other]
    assert await api.ids("shelved=true") == [alarm_id]
    assert await api.ids("shelved=any") == [other, alarm_id]
    assert (await api.get(f"/alarms/{alarm_id}")).body["shelved_until"] == shelf["until"]
    trail = (await api.get(f"/alarms/{alarm_id}/audit")).body["items"]
    assert (trail[-1]["action"], trail[-1]["actor"]) == ("shelve", "console")

    again = await api.post(
        "/shelves", {"device_id": "pump", "rule_key": "hot", "duration_s": 60, "reason": "x"}
    )
    assert (again.status, again.body["error"], again.body["shelf_id"]) == (
        409, "ALREADY_SHELVED", shelf["id"],
    )  # fmt: skip
    too_long = await api.post(f"/alarms/{other}/shelve", {"duration_s": 86401, "reason": "x"})
    assert (too_long.status, too_long.body["error"]) == (400, "SHELF_TOO_LONG")
    missing = await api.post("/alarms/999999/shelve", {"duration_s": 60, "reason": "x"})
    assert (missing.status, missing.body["error"]) == (404, "NOT_FOUND")
    for path, body in (
        (f"/alarms/{other}/shelve", {"duration_s": 60, "reason": "  "}),
        (f"/alarms/{other}/shelve", {"duration_s": 0.5, "reason": "x"}),
        (f"/alarms/{other}/shelve", {"duration_s": 60}),
        (f"/alarms/{other}/shelve", {"scope": "rule", "duration_s": 60, "reason": "x"}),
        ("/shelves", {"device_id": "fan", "duration_s": 60, "reason": "x"}),
        ("/shelves", {"device_id": "fan", "rule_key": "hot", "alarm_id": 1, "duration_s": 60,
                      "reason": "x"}),
    ):  # fmt: skip
        reply = await api.post(path, body)
        assert (reply.status, reply.body["error"]) == (422, "INVALID_BODY"), body
    listed = (await api.get("/shelves")).body["items"]
    assert [s["id"] for s in listed] == [shelf["id"]]

    lifted = await api.call("DELETE", f"/shelves/{shelf['id']}", token=OPERATOR)
    assert lifted.status == 200, lifted.body
    assert (lifted.body["end_reason"], lifted.body["ended_by"]) == ("lifted", "console")
    assert await api.ids("") == [other, alarm_id]
    ended = await api.call("DELETE", f"/shelves/{shelf['id']}", token=OPERATOR)
    assert (ended.status, ended.body["error"]) == (409, "SHELF_ENDED")
    assert (await api.get("/shelves")).body["items"] == []
    assert len((await api.get("/shelves?in_force=false")).body["items"]) == 1
    nothing = await api.call("DELETE", "/shelves/424242", token=OPERATOR)
    assert (nothing.status, nothing.body["error"]) == (404, "NOT_FOUND")


async def test_out_of_service_on_the_device_and_its_alarms(api: Api) -> None:
    await api.db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('m1', now(), now())"
    )
    until = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
    reply = await api.call(
        "PUT", "/devices/m1/out-of-service", json={"reason": "calibration", "until": until},
        token=OPERATOR,
    )  # fmt: skip
    assert reply.status == 200, reply.body
    assert (reply.body["set_by"], reply.body["reason"]) == ("console", "calibration")
    device = (await api.get("/devices/m1")).body["device"]
    assert device["out_of_service"]["id"] == reply.body["id"]
    alarm_id = await api.raise_alarm("m1")
    assert (await api.get(f"/alarms/{alarm_id}")).body["out_of_service"] is True

    ended = await api.call("DELETE", "/devices/m1/out-of-service", token=OPERATOR)
    assert (ended.status, ended.body["ended_by"]) == (200, "console")
    assert (await api.get("/devices/m1")).body["device"]["out_of_service"] is None
    again = await api.call("DELETE", "/devices/m1/out-of-service", token=OPERATOR)
    assert (again.status, again.body["error"]) == (409, "NOT_OUT_OF_SERVICE")
    unknown = await api.call(
        "PUT", "/devices/nope/out-of-service", json={"reason": "x"}, token=OPERATOR
    )
    assert (unknown.status, unknown.body["error"]) == (404, "NOT_FOUND")
    past = await api.call(
        "PUT", "/devices/m1/out-of-service",
        json={"reason": "x", "until": "2020-01-01T00:00:00Z"}, token=OPERATOR,
    )  # fmt: skip
    assert (past.status, past.body["error"]) == (400, "UNTIL_PAST")
    naive = await api.call(
        "PUT", "/devices/m1/out-of-service",
        json={"reason": "x", "until": "2099-01-01T00:00:00"}, token=OPERATOR,
    )  # fmt: skip
    assert (naive.status, naive.body["error"]) == (422, "INVALID_BODY")
    viewer = await api.call("PUT", "/devices/m1/out-of-service", json={"reason": "x"},
                            token=VIEWER)  # fmt: skip
    assert viewer.status == 403
    assert await api.db.fetchval("SELECT count(*) FROM device_out_of_service") == 1


@pytest.mark.parametrize("until", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
async def test_out_of_service_until_past_the_ends_of_time_in_utc_is_a_422(
    api: Api, until: str
) -> None:
    await api.db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('m1', now(), now())"
    )
    reply = await api.call(
        "PUT", "/devices/m1/out-of-service", json={"reason": "x", "until": until}, token=OPERATOR
    )
    assert (reply.status, reply.body["error"]) == (422, "INVALID_BODY"), reply.body
    assert "until" in reply.body["detail"]
    assert await api.db.fetchval("SELECT count(*) FROM device_out_of_service") == 0


async def test_out_of_service_until_answers_with_its_offset_and_the_last_day_is_refused(
    api: Api,
) -> None:
    """The driver keeps 9999-12-31T23:59:59.999999Z as PostgreSQL's infinity and reads it back
    without an offset: a time on the last day is refused (the document's pattern says so), one
    on the day before kept, whatever its offset, and answered in UTC."""
    await api.db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('m1', now(), now())"
    )
    last = await api.call(
        "PUT", "/devices/m1/out-of-service",
        json={"reason": "x", "until": "9999-12-31T23:59:59.999999Z"}, token=OPERATOR,
    )  # fmt: skip
    assert (last.status, last.body["error"]) == (422, "INVALID_BODY"), last.body
    assert await api.db.fetchval("SELECT count(*) FROM device_out_of_service") == 0

    kept = await api.call(
        "PUT", "/devices/m1/out-of-service",
        json={"reason": "x", "until": "9999-12-30T23:59:59.999999-23:59"}, token=OPERATOR,
    )  # fmt: skip
    in_utc = "9999-12-31T23:58:59.999999Z"
    assert (kept.status, kept.body["until"]) == (200, in_utc), kept.body
    device = (await api.get("/devices/m1")).body["device"]
    assert device["out_of_service"]["until"] == in_utc
