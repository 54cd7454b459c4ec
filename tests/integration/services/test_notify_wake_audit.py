"""Audit of 3f233f1 (a FAILED window wakes the groups that deferred to it) and ea7b22d (a
repeat lists only the alarms its route accepts): an open alarm's reminders are never
silently lost, nobody is reminded twice per interval."""

from __future__ import annotations

import asyncpg

from gateway.alarms.shelving import lift
from tests.integration.services.test_notify_group_routes import ESCALATIONS, HOT_THEN_COLD, _route
from tests.integration.services.test_notify_grouping import (
    _config,
    _consume_together,
    _day_window_sent,
    _escalate,
    _interval_passed,
    _make_due,
    _raise,
    _reload_all,
    _sent_long_ago,
    _shelve,
    _two_nodes,
    _window_status,
    _windows,
)
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

# Grouping by device, to hook: only "hot" alarms; then a "cold" route inserted ahead of it
# (the hot route moves to place 1, unchanged: the same route, still sending hot alarms).
_BY_DEVICE = ('group_by = ["rule"]', 'group_by = ["device"]')
HOT_THEN_COLD_BY_DEVICE = HOT_THEN_COLD.replace(*_BY_DEVICE)
_HOT, _COLD = HOT_THEN_COLD_BY_DEVICE.split("[[notify.routes]]")[1:]
ONLY_HOT_BY_DEVICE = "[[notify.routes]]" + _HOT
COLD_THEN_HOT_BY_DEVICE = "[[notify.routes]]" + _COLD + "[[notify.routes]]" + _HOT


async def test_a_moved_routes_alarm_is_still_reminded_when_another_route_takes_its_place(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Hot alarm a told by the hot route's group `routes[0]{device=dev-0}`. A reload inserts
    a cold route ahead of it: the hot route moves to place 1 (still sending hot alarms to
    hook, still repeating). A cold alarm of the same device then lands in the group row at
    `routes[0]{device=dev-0}`, which becomes the cold route's. Its repeat leaves a out (not
    the cold route's) and no other group carries a: hook is never reminded of the open hot
    alarm its route still sends it."""
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), ONLY_HOT_BY_DEVICE)) as nodes,
    ):
        a, first = await _day_window_sent(db, nodes, "dev-0", "hot", 0)
        assert first["body"]["group_key"] == "routes[0]{device=dev-0}"
        _reload_all(nodes, _config(server.url(""), COLD_THEN_HOT_BY_DEVICE))
        c, cold = await _day_window_sent(db, nodes, "dev-0", "cold", 1)
        assert cold["body"]["group_key"] == "routes[0]{device=dev-0}"
        await _sent_long_ago(db, cold["id"])
        await _consume_together(nodes)
        repeats = [w for w in await _windows(db) if w["body"]["repeat"]]
        listed = [n["alarm_id"] for w in repeats for n in w["body"]["notifications"]]
        assert a in listed, "nobody reminds hook of the open hot alarm its route sends it"
        assert sorted(listed) == sorted([a, c])


ONLY_COLD_BY_DEVICE = "[[notify.routes]]" + _HOT.replace('rules = ["hot"]', 'rules = ["cold"]')


async def test_a_route_edit_reverted_brings_its_groups_reminders_back(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The operator edits the hot route (grouping by device) to send cold alarms instead,
    then reverts the edit. While edited, the group's repeat lists none of its hot alarms
    (ea7b22d) and it stops repeating. Reverted, the route sends the open hot alarm to hook
    again with its repeats, as before: hook must be reminded of it, as it is after a route
    removed and put back (its group re-timed to 0 and back)."""
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), ONLY_HOT_BY_DEVICE)) as nodes,
    ):
        a, first = await _day_window_sent(db, nodes, "dev-0", "hot", 0)
        await _sent_long_ago(db, first["id"])
        _reload_all(nodes, _config(server.url(""), ONLY_COLD_BY_DEVICE))
        await _consume_together(nodes)
        assert len(await _windows(db)) == 1, "the edited route reminded of a hot alarm"
        _reload_all(nodes, _config(server.url(""), ONLY_HOT_BY_DEVICE))
        await _consume_together(nodes)
        windows = await _windows(db)
        assert len(windows) == 2, "the reverted route never reminds of its open alarm"
        assert windows[-1]["body"]["repeat"] is True
        assert [n["alarm_id"] for n in windows[-1]["body"]["notifications"]] == [a]


_HOT_ESC = _route('["hot"]', events=ESCALATIONS).replace(*_BY_DEVICE)
_COLD_PLAIN = _route('["cold"]').replace(*_BY_DEVICE)


async def test_a_moved_routes_alarm_escalated_after_the_move_is_reminded_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """As the first test, but the hot alarm is escalated after the move: its escalation
    goes to the hot route's group at its new place (`routes[1]{device=dev-0}`), which
    reminds of it from then on. The group the cold route took over at `routes[0]` must
    leave it out: one reminder per interval of one alarm by one route."""
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), _HOT_ESC)) as nodes,
    ):
        a, _ = await _day_window_sent(db, nodes, "dev-0", "hot", 0)
        _reload_all(nodes, _config(server.url(""), _COLD_PLAIN + _HOT_ESC))
        await _raise(db, "dev-0", "cold", 1)
        await _consume_together(nodes)
        await _escalate(db, a)
        await _consume_together(nodes)
        [_, *later] = await _windows(db)
        keys = sorted(w["body"]["group_key"] for w in later)
        assert keys == ["routes[0]{device=dev-0}", "routes[1]{device=dev-0}"]
        for window in later:
            await _make_due(db, window["id"])
        for window in later:
            await wait_until(
                lambda w=window: _window_status(db, w["id"], "SENT"),  # type: ignore[misc]
                message="sent",
            )
            await _sent_long_ago(db, window["id"])
        await _consume_together(nodes)
        repeats = [w for w in await _windows(db) if w["body"]["repeat"]]
        listed = [n["alarm_id"] for w in repeats for n in w["body"]["notifications"]]
        assert listed.count(a) == 1, "hook reminded twice per interval of the hot alarm"


async def test_a_reload_leaves_a_group_stopped_under_a_shelf_alone_and_its_end_still_tells(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """A group whose one open alarm is shelved stopped repeating (nothing to list). A reload
    does not wake it (a fleet's groups stopped under a maintenance shelf would each make an
    empty pass at every start and reload); the shelf's end still owes it its repeat."""
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), ONLY_HOT_BY_DEVICE)) as nodes,
    ):
        a, first = await _day_window_sent(db, nodes, "dev-0", "hot", 0)
        async with db.transaction():
            shelf = await _shelve(db, "alarm", a)
        await _sent_long_ago(db, first["id"])
        await _consume_together(nodes)
        stopped = "SELECT repeat_stopped FROM notify_group"
        assert await db.fetchval(stopped) is True
        _reload_all(nodes, _config(server.url(""), ONLY_HOT_BY_DEVICE.replace("3600", "7200")))
        await _consume_together(nodes)
        assert await db.fetchval(stopped) is True, "woken by the reload with nothing to list"
        assert len(await _windows(db)) == 1
        async with db.transaction():
            await lift(db, shelf["id"], actor="op", node_id="n0", request_id=None)
        await _interval_passed(db)
        await _consume_together(nodes)
        [*_, repeat] = await _windows(db)
        assert repeat["body"]["repeat"] is True
        assert [n["alarm_id"] for n in repeat["body"]["notifications"]] == [a]
