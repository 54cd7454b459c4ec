"""A route's groups are known by what the route is (its identity), not its place in the list:
a route removed from the head of the list hands its groups to nobody, and a route moved keeps
its own."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from tests.integration.services.test_notify_grouping import (
    Node,
    _config,
    _consume_together,
    _escalate,
    _make_due,
    _one_window_sent,
    _reload,
    _sent_long_ago,
    _two_nodes,
    _window_status,
    _windows,
)
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

ESCALATIONS = '["alarm.created", "alarm.escalated"]'


def _route(rules: str, *, events: str = '["alarm.created"]', repeat_s: int = 3600) -> str:
    """A route grouping by rule to hook."""
    return f"""
[[notify.routes]]
events = {events}
rules = {rules}
receivers = ["hook"]
group_by = ["rule"]
group_wait_s = 60
group_interval_s = 300
repeat_interval_s = {repeat_s}
"""


HOT_THEN_COLD = _route('["hot"]') + _route('["cold"]')
ONLY_COLD = _route('["cold"]')


async def test_removing_the_first_route_ends_its_groups_repeats(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The operator removes the route sending "hot" alarms to hook; the "cold" route moves
    to its place. No route sends hot alarms to hook any more: their group must stop
    repeating, as when the route is removed from the end of the list."""
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), HOT_THEN_COLD)) as nodes,
    ):
        window = await _one_window_sent(db, nodes)
        assert window["body"]["group_key"] == "routes[0]{rule=hot}"
        for node in nodes:
            _reload(node, _config(server.url(""), ONLY_COLD))
        await _sent_long_ago(db, window["id"])
        await _consume_together(nodes)
        assert len(await _windows(db)) == 1, "the removed route's group repeated"


HOT = _route('["hot"]', events=ESCALATIONS)
# A route inserted ahead of HOT, which moves to place 1 and repeats every ten minutes now.
COLD_THEN_HOT = _route('["cold"]') + _route('["hot"]', events=ESCALATIONS, repeat_s=600)


async def _escalated_at_the_new_place(
    db: asyncpg.Connection, nodes: tuple[Node, Node], alarm_id: int, first: dict[str, Any]
) -> None:
    """After HOT moved to place 1: the alarm escalated, its escalation sent in the group at
    the route's new place; both that window and ``first`` (the group at its old place) sent
    repeat_interval_s ago, and both nodes pass."""
    await _escalate(db, alarm_id)
    await _consume_together(nodes)
    [*_, moved] = await _windows(db)
    assert moved["body"]["group_key"] == "routes[1]{rule=hot}"
    await _make_due(db, moved["id"])
    await wait_until(lambda: _window_status(db, moved["id"], "SENT"), message="sent")
    await _sent_long_ago(db, first["id"])
    await _sent_long_ago(db, moved["id"])
    await _consume_together(nodes)


async def test_a_route_moved_in_the_list_keeps_its_groups_and_reminds_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """A reload inserts a route ahead of the one that made a group and shortens its repeats:
    the group is still that route's (its intervals follow it). The alarm's escalation after
    the reload goes to the group of the route's new place; the receiver is reminded of the
    alarm once per interval, by that group (the newest notification), not by both."""
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), HOT)) as nodes,
    ):
        first = await _one_window_sent(db, nodes)
        assert first["body"]["group_key"] == "routes[0]{rule=hot}"
        for node in nodes:
            _reload(node, _config(server.url(""), COLD_THEN_HOT))
        await _consume_together(nodes)
        intervals = "SELECT repeat_interval_s FROM notify_group WHERE group_key = $1"
        assert await db.fetchval(intervals, "routes[0]{rule=hot}") == 600
        [a, *_] = [r["id"] for r in await db.fetch("SELECT id FROM alarm ORDER BY id")]
        await _escalated_at_the_new_place(db, nodes, a, first)
        repeats = [w for w in await _windows(db) if w["body"]["repeat"]]
        listed = [
            (
                w["body"]["group_key"],
                [(n["alarm_id"], n["event"]) for n in w["body"]["notifications"]],
            )
            for w in repeats
        ]
        # The old group repeats its other alarm (dev-1's), not a; the new one repeats a.
        others = [r["id"] for r in await db.fetch("SELECT id FROM alarm WHERE id <> $1", a)]
        assert sorted(listed) == [
            ("routes[0]{rule=hot}", [(others[0], "alarm.created")]),
            ("routes[1]{rule=hot}", [(a, "alarm.escalated")]),
        ]


@pytest.mark.parametrize(
    ("rules", "repeats"),
    [('["hot", "warm"]', True), ('["warm"]', False)],
    ids=["still-matches", "no-longer-matches"],
)
async def test_a_route_edited_in_place_keeps_the_groups_it_still_accepts(
    db_dsn: str, db: asyncpg.Connection, rules: str, repeats: bool
) -> None:
    """A reload edits the route in place (its rules, so another identity) and shortens its
    repeats: the group of "hot" alarms is still the route's while the route accepts them
    (its reminders are not lost to an edit), at the new interval; a route that no longer
    accepts "hot" makes the group repeat no more."""
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), HOT)) as nodes,
    ):
        window = await _one_window_sent(db, nodes)
        edited = _route(rules, events=ESCALATIONS, repeat_s=600)
        for node in nodes:
            _reload(node, _config(server.url(""), edited))
        await db.execute(
            "UPDATE notify_delivery SET finished_at = finished_at - interval '601 s' WHERE id = $1",
            window["id"],
        )
        await _consume_together(nodes)
        assert await db.fetchval("SELECT repeat_interval_s FROM notify_group") == (
            600 if repeats else 0
        )
        assert len(await _windows(db)) == (2 if repeats else 1)
