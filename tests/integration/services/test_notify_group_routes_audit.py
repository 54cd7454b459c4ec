"""Audit of the route identity (dd44141) and the one-reminder rule: an open alarm's
reminders are never silently lost."""

from __future__ import annotations

import asyncpg

from tests.integration.services.test_notify_group_routes import (
    COLD_THEN_HOT,
    HOT,
    HOT_THEN_COLD,
    ONLY_COLD,
    _escalated_at_the_new_place,
)
from tests.integration.services.test_notify_grouping import (
    _config,
    _consume_together,
    _day_window_sent,
    _reload_all,
    _sent_long_ago,
    _two_nodes,
    _window_status,
    _windows,
)
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until


async def test_a_group_that_deferred_its_alarm_reminds_again_when_the_newer_group_fails(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """docs/notifications.md, "One reminder per alarm and route": the others leave the alarm
    out "unless the one that carried the newest does not repeat (... its latest window
    FAILED): then the others go on reminding of it". Alarm a told by the route at place 0;
    a reload moves the route to place 1 and a's escalation goes to that group. The old group
    leaves a out at its repeat (nothing else left: it stops); the new group's repeat then
    FAILS (the receiver down). The old group must remind of a again: nobody else will."""
    # hook: the first window and the escalation sent; the new group's repeat refused at
    # every attempt (max_attempts = 5); later ones accepted.
    async with (
        webhook_server(hook=lambda k, _r: 500 if 2 <= k <= 6 else 200) as server,
        _two_nodes(db_dsn, _config(server.url(""), HOT)) as nodes,
    ):
        a, first = await _day_window_sent(db, nodes, "dev-0", "hot", 0)
        _reload_all(nodes, _config(server.url(""), COLD_THEN_HOT))
        await _consume_together(nodes)
        await _escalated_at_the_new_place(db, nodes, a, first)
        [_, _, repeat] = await _windows(db)
        assert repeat["body"]["group_key"] == "routes[1]{rule=hot}"
        await wait_until(lambda: _window_status(db, repeat["id"], "FAILED"), message="failed")
        await _consume_together(nodes)
        windows = await _windows(db)
        assert len(windows) == 4, "nobody reminds of the open, escalated alarm"
        assert windows[-1]["body"]["group_key"] == "routes[0]{rule=hot}"
        assert [n["alarm_id"] for n in windows[-1]["body"]["notifications"]] == [a]


# Two routes grouping by device, both to hook: "hot" alarms first, "cold" ones after.
HOT_THEN_COLD_BY_DEVICE = HOT_THEN_COLD.replace('group_by = ["rule"]', 'group_by = ["device"]')
ONLY_COLD_BY_DEVICE = ONLY_COLD.replace('group_by = ["rule"]', 'group_by = ["device"]')


async def test_a_removed_routes_alarm_is_not_repeated_by_the_route_moved_into_its_place(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The operator removes the route sending "hot" alarms to hook; the "cold" route (both
    grouping by device) moves to its place. A cold alarm of the same device then lands in
    the very group row the hot route made (same receiver, same key `routes[0]{device=...}`),
    whose repeats list every open alarm it carried: hook must not be reminded of the hot
    alarm, which no route sends it any more."""
    async with webhook_server() as server:
        config = _config(server.url(""), HOT_THEN_COLD_BY_DEVICE)
        async with _two_nodes(db_dsn, config) as nodes:
            a, first = await _day_window_sent(db, nodes, "dev-0", "hot", 0)
            assert first["body"]["group_key"] == "routes[0]{device=dev-0}"
            _reload_all(nodes, _config(server.url(""), ONLY_COLD_BY_DEVICE))
            c, cold = await _day_window_sent(db, nodes, "dev-0", "cold", 1)
            assert cold["body"]["group_key"] == "routes[0]{device=dev-0}"
            await _sent_long_ago(db, cold["id"])
            await _consume_together(nodes)
            [*_, repeat] = await _windows(db)
            assert repeat["body"]["repeat"] is True
            listed = [n["alarm_id"] for n in repeat["body"]["notifications"]]
            assert a not in listed, "the removed route's alarm repeated to hook"
            assert listed == [c]
