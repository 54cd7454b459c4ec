"""A group reminds its receiver of an alarm only while its route would still send that
receiver the alarm's notification: the route's events, and its place in the list (the first
route that matches decides unless it says ``continue``), not only its rule, device and
severity matchers. Two nodes, the real database."""

from __future__ import annotations

import asyncpg
import pytest

from tests.integration.services.test_notify_grouping import (
    ONLY_GROUPED,
    _config,
    _consume_together,
    _one_window_sent,
    _reload,
    _sent_long_ago,
    _two_nodes,
    _windows,
)
from tests.support.receivers import webhook_server

# A route put ahead of the grouping one, without continue: alarm.created goes to "each" only.
AHEAD = (
    """
[[notify.routes]]
events = ["alarm.created"]
receivers = ["each"]
"""
    + ONLY_GROUPED
)

# The grouping route edited in place to send only alarm.cleared: an open alarm's creation is
# no longer sent to "hook".
CLEARED_ONLY = ONLY_GROUPED.replace('events = ["alarm.created"]', 'events = ["alarm.cleared"]')

# The control: a route put ahead that takes another rule's alarms (the group's still reach it).
AHEAD_OTHER_RULE = (
    """
[[notify.routes]]
events = ["alarm.created"]
rules = ["cold"]
receivers = ["each"]
"""
    + ONLY_GROUPED
)


@pytest.mark.parametrize(
    ("reloaded", "repeats"),
    [(AHEAD, False), (CLEARED_ONLY, False), (AHEAD_OTHER_RULE, True)],
    ids=["route-ahead", "events-edited", "control-route-ahead-for-another-rule"],
)
async def test_a_group_whose_route_no_longer_reaches_its_receiver_stops_reminding(
    db_dsn: str, db: asyncpg.Connection, reloaded: str, repeats: bool
) -> None:
    """Two alarms of rule ``hot`` grouped for "hook" and sent; then a reload. A route put
    ahead of the grouping one without ``continue`` that takes every alarm.created to "each",
    or the grouping route edited to send only ``alarm.cleared``, means "hook" is sent these
    alarms no more: an operator who took the alarms away from a receiver is not reminded of
    them every repeat_interval_s until each closes (config.example.toml: a group whose
    route no longer sends to its receiver stops repeating). A route put ahead for another
    rule changes nothing for the group."""
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            window = await _one_window_sent(db, nodes)
            for node in nodes:
                _reload(node, _config(server.url(""), reloaded))
            await _sent_long_ago(db, window["id"])
            await _consume_together(nodes)
            windows = await _windows(db)
            if repeats:
                assert len(windows) == 2
                assert windows[-1]["body"]["repeat"] is True
                assert windows[-1]["body"]["count"] == 2
            else:
                assert len(windows) == 1, "reminded of alarms its route no longer sends"
                assert await db.fetchval("SELECT repeat_stopped FROM notify_group") is True
