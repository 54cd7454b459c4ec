"""A bulk action over a group "up to its newest id" against alarms whose ids were given before
the group was read but whose transactions committed after it (several nodes' ingest batches
commit out of id order): nobody saw such an alarm, and the action leaves it alone. Real HTTP,
real PostgreSQL; the late commit is a transaction held open on a second connection."""

from __future__ import annotations

import uuid

import asyncpg

from gateway.alarms.lifecycle import create_alarm
from storage.alarms import db_now
from tests.integration.api.test_alarm_desk_audit import Api, api
from tests.support.api_client import OPERATOR

__all__ = ["api"]


async def _raise_uncommitted(conn: asyncpg.Connection, device: str) -> int:
    created = await create_alarm(
        conn, device_id=device, rule_key="hot", severity="MAJOR",
        telemetry_event_id=uuid.uuid4().hex, reason="test", node_id="other-node",
        now=await db_now(conn),
    )  # fmt: skip
    assert created.alarm is not None
    return created.alarm.id


async def test_a_bulk_action_up_to_a_groups_newest_id_leaves_an_alarm_committed_after_the_read(
    api: Api,
) -> None:
    other = await asyncpg.connect(api.dsn)
    try:
        late = other.transaction()
        await late.start()
        hidden = await _raise_uncommitted(other, "a")  # its id is given now ...
        seen = await api.raise_alarm("b")  # ... this one's after it, committed first
        assert seen > hidden
        group = (await api.get("/alarms/groups?by=rule")).body["items"][0]
        assert (group["key"], group["count"], group["newest_id"]) == ("hot", 1, seen)
        await late.commit()  # ... and it commits after the operator read the group
    finally:
        await other.close()
    # What the console sends: the group as it was read.
    shown = {k: group[k] for k in ("newest_id", "as_of") if k in group}
    body = {
        "action": "confirm",
        "group": {
            "by": "rule",
            "key": "hot",
            "up_to": shown["newest_id"],
            **({"as_of": shown["as_of"]} if "as_of" in shown else {}),
        },
    }
    reply = await api.post("/alarms/bulk", body)
    assert reply.status == 200, reply.body
    assert (await api.get(f"/alarms/{hidden}")).body["status"] == "NEW"
    assert [i["alarm_id"] for i in reply.body["items"]] == [seen]
    # Read again, the group shows it; acted on as read now, it is confirmed too.
    again = (await api.get("/alarms/groups?by=rule&acknowledged=false")).body["items"][0]
    assert (again["count"], again["newest_id"]) == (1, hidden)
    body["group"] = {
        "by": "rule",
        "key": "hot",
        "filters": {"acknowledged": False},
        "up_to": again["newest_id"],
        "as_of": again["as_of"],
    }
    reply = await api.post("/alarms/bulk", body)
    assert [i["alarm_id"] for i in reply.body["items"]] == [hidden]


async def test_a_bulk_groups_as_of_is_refused_only_when_it_is_no_read(api: Api) -> None:
    """Out of the document's pattern: 422. Within it, whatever its numbers (a client's own):
    taken, never an error (they select what they say)."""
    await api.raise_alarm("a")
    for bad in ("", "x", "3:9:", "3:9:@", "3:9:@12345678901234567", "1:2:3:4@5", 7):
        body = {"action": "confirm", "group": {"by": "rule", "key": "hot", "as_of": bad}}
        refused = await api.post("/alarms/bulk", body)
        assert (refused.status, refused.body["error"]) == (422, "INVALID_BODY"), bad
    for odd in ("5:3:@1", "0:0:@0", "3:9:10,4@1", "99999999999999999999:99999999999999999999:@1"):
        body = {"action": "confirm", "group": {"by": "rule", "key": "hot", "as_of": odd}}
        taken = await api.post("/alarms/bulk", body)
        assert taken.status == 200, (odd, taken.body)


async def test_a_bulk_action_over_a_group_as_read_leaves_an_alarm_the_read_showed_shelved(
    api: Api,
) -> None:
    """An alarm shelved when the group was read was not in it (the default view leaves
    shelved alarms out); its shelf lifted before the bulk action, it is still one nobody on
    this desk saw in the group, and is left alone."""
    hidden = await api.raise_alarm("a")
    shelf = await api.post(
        f"/alarms/{hidden}/shelve", {"duration_s": 3600, "reason": "sensor being replaced"}
    )
    assert shelf.status == 201, shelf.body
    seen = await api.raise_alarm("b")
    group = (await api.get("/alarms/groups?by=rule")).body["items"][0]
    assert (group["count"], group["newest_id"]) == (1, seen)
    lifted = await api.call("DELETE", f"/shelves/{shelf.body['id']}", token=OPERATOR)
    assert lifted.status == 200, lifted.body
    body = {
        "action": "confirm",
        "group": {"by": "rule", "key": "hot", "up_to": group["newest_id"],
                  "as_of": group["as_of"]},
    }  # fmt: skip
    reply = await api.post("/alarms/bulk", body)
    assert reply.status == 200, reply.body
    assert [i["alarm_id"] for i in reply.body["items"]] == [seen]
    assert (await api.get(f"/alarms/{hidden}")).body["status"] == "NEW"
