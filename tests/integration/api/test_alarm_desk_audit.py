"""Two operators on the alarm desk at once, over real HTTP against real PostgreSQL: the
moments their requests meet are forced with a transaction held open on a second connection
(running the gateway's own code, as the other operator's request or the other node's timer
would), and released once the request under test waits for it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import asyncpg
import pytest

from gateway.alarms import shelving
from gateway.alarms.lifecycle import create_alarm, transition
from gateway.domain.alarm import Action
from storage.alarms import db_now
from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.support.api_client import OPERATOR, ApiClient, Reply
from tests.support.api_server import serve_api
from tests.support.waiting import wait_until

T = TypeVar("T")


@dataclass
class Api(ApiClient):
    db: asyncpg.Connection
    dsn: str

    async def put(self, path: str, body: Any, *, token: str = OPERATOR) -> Reply:
        return await self.call("PUT", path, json=body, token=token)

    async def post(self, path: str, body: Any, *, token: str = OPERATOR) -> Reply:
        return await self.call("POST", path, json=body, token=token)

    async def raise_alarm(self, device: str, rule: str = "hot") -> int:
        async with self.db.transaction():
            created = await create_alarm(
                self.db, device_id=device, rule_key=rule, severity="MAJOR",
                telemetry_event_id=uuid.uuid4().hex, reason="test", node_id="n",
                now=await db_now(self.db),
            )  # fmt: skip
        assert created.alarm is not None
        return created.alarm.id

    async def a_request_waits_for_a_lock(self) -> bool:
        return bool(
            await self.db.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        )

    async def while_held(
        self,
        hold: Callable[[asyncpg.Connection], Awaitable[T]],
        request: Callable[[], Awaitable[Reply]],
        message: str,
    ) -> tuple[T, Reply]:
        """Operator A's step (``hold``, the gateway's own code) run in a transaction on a
        second connection and held open until ``request`` (operator B's, sent then) waits for
        one of its locks; then A commits. What ``hold`` returned, and B's reply."""
        other = await asyncpg.connect(self.dsn)
        try:
            held = other.transaction()
            await held.start()
            mine = await hold(other)
            task = asyncio.create_task(request())
            await wait_until(self.a_request_waits_for_a_lock, message=message)
            await held.commit()
            return mine, await task
        finally:
            await other.close()


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db, dsn=db_dsn)


@pytest.mark.parametrize("in_force_before", [False, True])
async def test_two_operators_putting_a_device_out_of_service_at_once_both_get_200(
    api: Api, in_force_before: bool
) -> None:
    """`PUT /devices/{id}/out-of-service` replaces a period in force. Operator A's request
    (its transaction held open here, run by the gateway's own code) has ended the period in
    force, if any, and written its own; operator B's request meets it. B must replace A's
    period (200), as it would a moment later, not fail with a 500 on the unique index of
    the open period."""
    await api.db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('m1', now(), now())"
    )
    if in_force_before:
        first = await api.put("/devices/m1/out-of-service", {"reason": "earlier"})
        assert first.status == 200, first.body
    mine, reply = await api.while_held(
        lambda c: shelving.set_out_of_service(
            c, "m1", reason="operator A", until=None, actor="olga", request_id=None
        ),
        lambda: api.put("/devices/m1/out-of-service", {"reason": "operator B"}),
        "B's request waits for A's transaction",
    )
    assert reply.status == 200, reply.body
    assert (reply.body["reason"], reply.body["set_by"]) == ("operator B", "console")
    device = (await api.get("/devices/m1")).body["device"]
    assert device["out_of_service"]["id"] == reply.body["id"]
    # A's period was replaced by B's: ended, by B.
    a_row = await api.db.fetchrow(
        "SELECT ended_at, ended_by FROM device_out_of_service WHERE id = $1", mine["id"]
    )
    assert a_row["ended_by"] == "console"
    assert (
        await api.db.fetchval("SELECT count(*) FROM device_out_of_service WHERE ended_at IS NULL")
        == 1
    )


async def test_ending_out_of_service_while_another_operator_replaces_the_period_ends_the_new_one(
    api: Api,
) -> None:
    """Operator A replaces the period in force (its transaction held open here); operator B's
    `DELETE /devices/{id}/out-of-service` waits for it, so it comes after A's: it must end the
    period A put in force (200), not answer 409 `NOT_OUT_OF_SERVICE` and leave the device out
    of service."""
    await api.db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('m1', now(), now())"
    )
    first = await api.put("/devices/m1/out-of-service", {"reason": "earlier"})
    assert first.status == 200, first.body
    mine, reply = await api.while_held(
        lambda c: shelving.set_out_of_service(
            c, "m1", reason="operator A", until=None, actor="olga", request_id=None
        ),
        lambda: api.call("DELETE", "/devices/m1/out-of-service", token=OPERATOR),
        "B's request waits for A's transaction",
    )
    assert reply.status == 200, reply.body
    assert (reply.body["id"], reply.body["ended_by"]) == (mine["id"], "console")
    assert (await api.get("/devices/m1")).body["device"]["out_of_service"] is None
    assert (
        await api.db.fetchval("SELECT count(*) FROM device_out_of_service WHERE ended_at IS NULL")
        == 0
    )


async def _a_shelf_past_its_until(api: Api, alarm_id: int) -> dict[str, Any]:
    """A shelf of the alarm, one second long, now past its until: no timer ended it yet."""
    reply = await api.post(f"/alarms/{alarm_id}/shelve", {"duration_s": 1, "reason": "brief"})
    assert reply.status == 201, reply.body
    shelf: dict[str, Any] = reply.body
    until = await api.db.fetchval("SELECT until FROM alarm_shelf WHERE id = $1", shelf["id"])

    async def past() -> bool:
        return bool(await api.db.fetchval("SELECT now() >= $1", until))

    await wait_until(past, message="the database clock reaches the shelf's until")
    return shelf


async def test_shelving_an_alarm_while_a_timer_ends_its_expired_shelf_shelves_it(api: Api) -> None:
    """An operator shelves an alarm again just as its shelf ran out: the request finds the
    shelf past its until and ends it, while another node's timer is ending it (its pass held
    open here). The timer's end is the end; nothing shelves the alarm any more, so the new
    shelf is made (201), not refused with 409 `ALREADY_SHELVED` naming the shelf that ended."""
    alarm_id = await api.raise_alarm("pump")
    old = await _a_shelf_past_its_until(api, alarm_id)
    timer = await asyncpg.connect(api.dsn)
    try:
        held = timer.transaction()
        await held.start()
        ended = await shelving.expire_due(
            timer, await db_now(timer), node_id="other-node", limit=10
        )
        assert [s["id"] for s in ended] == [old["id"]]
        request = asyncio.create_task(
            api.post(f"/alarms/{alarm_id}/shelve", {"duration_s": 600, "reason": "again"})
        )
        await wait_until(
            api.a_request_waits_for_a_lock, message="the shelve waits for the timer's pass"
        )
        await held.commit()
        reply = await request
    finally:
        await timer.close()
    assert reply.status == 201, reply.body
    assert reply.body["id"] != old["id"]
    assert (reply.body["reason"], reply.body["shelved_by"]) == ("again", "console")
    assert (await api.get(f"/alarms/{alarm_id}")).body["shelved_until"] == reply.body["until"]
    trail = [
        (r["action"], r["actor"])
        for r in (await api.get(f"/alarms/{alarm_id}/audit")).body["items"]
    ]
    assert trail[-3:] == [
        ("shelve", "console"), ("unshelve", "system:shelving"), ("shelve", "console"),
    ]  # fmt: skip


async def test_two_operators_renewing_an_expired_shelf_at_once_the_loser_is_told_the_new_shelf(
    api: Api,
) -> None:
    """Two operators shelve an alarm whose shelf ran out (no timer ended it yet). A's request
    (held open here) ended it and made its own; B's, waiting for A's, is refused with 409
    `ALREADY_SHELVED`: the shelf in the way is A's, in force, not the one that ended."""
    alarm_id = await api.raise_alarm("pump")
    old = await _a_shelf_past_its_until(api, alarm_id)
    mine, reply = await api.while_held(
        lambda c: shelving.shelve(
            c,
            scope="alarm",
            alarm_id=alarm_id,
            device_id=None,
            rule_key=None,
            seconds=600,
            reason="operator A",
            actor="olga",
            node_id="other-node",
            request_id=None,
        ),
        lambda: api.post(f"/alarms/{alarm_id}/shelve", {"duration_s": 600, "reason": "operator B"}),
        "B's shelve waits for A's transaction",
    )
    assert reply.status == 409, reply.body
    assert (reply.body["error"], reply.body["shelf_id"]) == ("ALREADY_SHELVED", mine["id"])
    assert mine["id"] != old["id"]
    assert await api.db.fetchval("SELECT count(*) FROM alarm_shelf") == 2


@dataclass(frozen=True)
class Race:
    first: Action | None  # a step taken before the race
    a_does: Action  # operator A's step (or the escalation timer's), held open
    b_does: str  # operator B's action, through the API
    status_after_a: str
    a_actor: str | None  # whom B's 409 names


RACES = [
    Race(None, Action.CONFIRM, "handle", "CONFIRMED", "olga"),
    Race(Action.CONFIRM, Action.HANDLE, "false", "HANDLED", "olga"),
    Race(Action.CONFIRM, Action.FALSE, "handle", "FALSE", "olga"),
    Race(Action.CONFIRM, Action.ESCALATE, "handle", "ESCALATED", None),
]


@pytest.mark.parametrize(
    "race",
    RACES,
    ids=["confirm-then-handle", "handle-then-false", "false-then-handle", "escalate-then-handle"],
)
async def test_two_steps_on_one_alarm_at_once_one_wins_and_the_other_gets_409(
    api: Api, race: Race
) -> None:
    """Operator B acts on the alarm as it stands while operator A (or the escalation timer)
    takes another step on it: A's transaction is held open here, and B's request reads the
    alarm, then waits for A's. A's step changed the status B's request read, so B lost the
    race: 409 `STATUS_CHANGED` with the status now and who took it, and nothing of B's is
    written (docs/behaviour.md §5, "Optimistic concurrency by prior status"; §14: two
    operators acting at once, exactly one wins, the other gets 409) -- not B's action applied
    on top of A's (a handle written over a confirmation B never saw) nor a 400
    `ILLEGAL_TRANSITION` as if B had asked for a step the alarm never allowed."""
    alarm_id = await api.raise_alarm("pump")
    if race.first is not None:
        assert (await api.post(f"/alarms/{alarm_id}/{race.first.value}", {})).status == 200
    audit_before = await api.db.fetchval(
        "SELECT count(*) FROM alarm_audit WHERE alarm_id = $1", alarm_id
    )
    _, reply = await api.while_held(
        lambda c: transition(
            c, alarm_id, race.a_does, actor=race.a_actor or "system:timers", node_id="other-node"
        ),
        lambda: api.post(f"/alarms/{alarm_id}/{race.b_does}", {"note": "B"}),
        "B's action waits for A's transaction",
    )
    assert reply.status == 409, reply.body
    assert (reply.body["error"], reply.body["current_status"], reply.body["actor"]) == (
        "STATUS_CHANGED", race.status_after_a, race.a_actor,
    )  # fmt: skip
    assert (await api.get(f"/alarms/{alarm_id}")).body["status"] == race.status_after_a
    trail = await api.db.fetch(
        "SELECT actor, action FROM alarm_audit WHERE alarm_id = $1 ORDER BY id", alarm_id
    )
    assert len(trail) == audit_before + 1
    assert trail[-1]["action"] == race.a_does.value


async def test_an_alarm_superseded_while_an_operator_confirms_it_is_still_400_alarm_superseded(
    api: Api,
) -> None:
    """The rule fires again (its ingest transaction held open here) while an operator confirms
    the alarm nobody attended: the refire supersedes it, and the confirm, waiting for it, is
    refused as every action on a superseded alarm is (400 `ALARM_SUPERSEDED`, naming the
    successor), not as a plain lost race."""
    alarm_id = await api.raise_alarm("pump")
    ingest = await asyncpg.connect(api.dsn)
    try:
        refire = ingest.transaction()
        await refire.start()
        created = await create_alarm(
            ingest, device_id="pump", rule_key="hot", severity="MAJOR",
            telemetry_event_id=uuid.uuid4().hex, reason="refire", node_id="ingest",
            now=await db_now(ingest),
        )  # fmt: skip
        assert created.alarm is not None
        request = asyncio.create_task(api.post(f"/alarms/{alarm_id}/confirm", {}))
        await wait_until(api.a_request_waits_for_a_lock, message="the confirm waits for it")
        await refire.commit()
        reply = await request
    finally:
        await ingest.close()
    assert (reply.status, reply.body["error"]) == (400, "ALARM_SUPERSEDED"), reply.body
    assert reply.body["superseded_by"] == created.alarm.id


async def test_a_bulk_action_over_a_group_up_to_its_newest_id_leaves_alarms_raised_since(
    api: Api,
) -> None:
    """`up_to`: the group as `GET /alarms/groups` showed it (its `newest_id`); an alarm that
    joined the group after that read is left alone."""
    first = await api.raise_alarm("a")
    second = await api.raise_alarm("b")
    group = (await api.get("/alarms/groups?by=rule")).body["items"][0]
    assert (group["key"], group["count"], group["newest_id"]) == ("hot", 2, second)
    later = await api.raise_alarm("c")
    body = {"action": "confirm", "group": {"by": "rule", "key": "hot", "up_to": second}}
    reply = await api.post("/alarms/bulk", body)
    assert reply.status == 200, reply.body
    assert sorted(i["alarm_id"] for i in reply.body["items"]) == [first, second]
    assert (await api.get(f"/alarms/{later}")).body["status"] == "NEW"
    for bad in (0, 1.5, -3, "7", 2**53 + 2):
        body["group"]["up_to"] = bad
        refused = await api.post("/alarms/bulk", body)
        assert (refused.status, refused.body["error"]) == (422, "INVALID_BODY"), bad
