"""Notifications held by quiet hours for an alarm that people (or a newer firing) dealt with
before the quiet hours ended: the night desk confirms or handles a DELAYED alarm, or a refire
supersedes it. The person the held notification was meant to wake at the quiet hours' end is
not told of an alarm somebody already took: its held deliveries are SUPPRESSED at that step,
naming it (final, visible, never sent), and one in a group's held window leaves the window.
Real PostgreSQL, a real webhook receiver, two nodes' consumers and workers."""

from __future__ import annotations

import asyncpg
import pytest

from gateway.alarms.delivery import hold
from gateway.alarms.service import AlarmService
from gateway.domain.alarm import Action
from tests.integration.services.test_notify_grouping import (
    ONLY_GROUPED,
    _config,
    _consume_together,
    _make_due,
    _quiet_now,
    _raise,
    _statuses,
    _timers,
    _two_nodes,
    _window_status,
    _windows,
)
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

UNGROUPED = '[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["each"]\n'


async def _held(db: asyncpg.Connection, alarm_id: int) -> list[asyncpg.Record]:
    return list(
        await db.fetch(
            "SELECT id, status, suppressed, attempts FROM notify_delivery"
            " WHERE alarm_id = $1 AND group_id IS NULL ORDER BY id",
            alarm_id,
        )
    )


async def _quiet_hours_over(db: asyncpg.Connection) -> None:
    """The held deliveries' estimate of the quiet hours' end has come (as the clock would)."""
    await db.execute("UPDATE notify_delivery SET next_attempt_at = now() WHERE status = 'PENDING'")


@pytest.mark.parametrize(
    ("action", "word"), [(Action.CONFIRM, "confirmed"), (Action.HANDLE, "handled")]
)
async def test_an_alarm_the_night_desk_took_sends_nothing_at_the_quiet_hours_end(
    db_dsn: str, db: asyncpg.Connection, pool: asyncpg.Pool, action: Action, word: str
) -> None:
    """care-0's MAJOR alarm is raised at night: DELAYED, its notification held until the
    quiet hours end. The night desk confirms (or handles) it at once. When the quiet hours'
    end comes, nothing is sent: the delivery was SUPPRESSED when the desk took the alarm.
    It used to be sent then, an "alarm created" for an alarm handled hours before (and
    still saying DELAYED)."""
    quiet = _quiet_now()
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), UNGROUPED)) as nodes,
    ):
        for node in nodes:
            node.consumer.quiet = quiet
        alarm = await _raise(db, "care-0", "hot", 0)
        await _consume_together(nodes)
        assert (await _statuses(db, [alarm]))[alarm] == "DELAYED"
        [held] = await _held(db, alarm)
        assert (held["status"], held["attempts"]) == ("PENDING", 0)
        await AlarmService(pool, "n1").act(alarm, action, actor="night-desk")
        await _quiet_hours_over(db)
        for node in nodes:
            await node.worker.run_once()
        [after] = await _held(db, alarm)
        assert server.on("/each") == [], "told of an alarm the night desk took"
        assert after["status"] == "SUPPRESSED"
        assert after["suppressed"] == f"{word} in quiet hours by night-desk"


async def test_a_refire_in_quiet_hours_leaves_one_notification_for_the_newer_alarm(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """care-0 fires at night (DELAYED, held), then fires again: the newer alarm supersedes
    the held one, and is held itself. At the wake, one notification goes, the newer
    alarm's. The superseded one's used to go as soon as its estimate came (its alarm no
    longer DELAYED, no claim held it): two pages for one chain, the first describing an
    alarm that no longer stood."""
    quiet = _quiet_now()
    async with webhook_server() as server:
        async with _two_nodes(db_dsn, _config(server.url(""), UNGROUPED)) as nodes:
            for node in nodes:
                node.consumer.quiet = quiet
            old = await _raise(db, "care-0", "hot", 0)
            await _consume_together(nodes)
            new = await _raise(db, "care-0", "hot", 1)
            await _consume_together(nodes)
            assert await _statuses(db, [old, new]) == {old: "SUPERSEDED", new: "DELAYED"}
            await _quiet_hours_over(db)
            for node in nodes:
                await node.worker.run_once()
            assert server.on("/each") == [], "the superseded alarm's held notification went"
            [gone] = await _held(db, old)
            assert gone["status"] == "SUPPRESSED"
            assert gone["suppressed"] == f"superseded in quiet hours by alarm {new}"
            assert (await _timers(nodes[0], "n1").run_once()).woken == [new]
            await wait_until(lambda: len(server.on("/each")) >= 1, message="the newer one")
            [sent] = await _held(db, new)
            await wait_until(lambda: _window_status(db, sent["id"], "SENT"), message="sent")
        assert [r.json["alarm_id"] for r in server.on("/each")] == [new]


async def test_an_alarm_the_night_desk_took_leaves_its_groups_held_window(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """care-0 and care-1 fire at night: their notifications gather in the group's held
    window. The night desk confirms care-0. At care-1's wake the window goes listing care-1
    only (care-0's notification recorded SUPPRESSED on its own, naming the confirmation). It
    used to list both."""
    quiet = _quiet_now()
    routes = ONLY_GROUPED.replace("group_wait_s = 60", "group_wait_s = 0")
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), routes)) as nodes,
    ):
        for node in nodes:
            node.consumer.quiet = quiet
        taken = await _raise(db, "care-0", "hot", 0)
        other = await _raise(db, "care-1", "hot", 1)
        await _consume_together(nodes)
        [night] = await _windows(db)
        assert night["body"]["group_key"] == "routes[0]{rule=hot}|held"
        await AlarmService(nodes[0].worker.pool, "n1").act(
            taken, Action.CONFIRM, actor="night-desk"
        )
        await _make_due(db, night["id"])
        assert (await _timers(nodes[0], "n1").run_once()).woken == [other]
        await wait_until(lambda: _window_status(db, night["id"], "SENT"), message="sent")
        [request] = server.on("/hook")
        listed = [x["alarm_id"] for x in request.json["notifications"]]
        assert listed == [other], "the window told of the alarm the night desk took"
        [own] = await _held(db, taken)
        assert own["status"] == "SUPPRESSED"
        assert own["suppressed"] == "confirmed in quiet hours by night-desk"


async def test_an_alarm_the_night_desk_took_before_the_consumer_read_it_sends_nothing(
    db_dsn: str, db: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """The same night, the notification consumer behind (its node restarting, the database
    slow): the outbox publisher holds care-0's alarm (DELAYED), and the night desk confirms
    it before any consumer has read its `alarm.created`. The notification the consumer makes
    then is SUPPRESSED, as the confirmation would have made it. It used to be due at once
    (its alarm no longer DELAYED) and went out in the middle of the night."""
    quiet = _quiet_now()
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), UNGROUPED)) as nodes,
    ):
        alarm = await _raise(db, "care-0", "hot", 0)
        async with db.transaction():
            await hold(db, alarm, quiet=quiet, node_id="n1")  # the publisher's decision
        assert (await _statuses(db, [alarm]))[alarm] == "DELAYED"
        await AlarmService(pool, "n1").act(alarm, Action.CONFIRM, actor="night-desk")
        await _consume_together(nodes)
        for node in nodes:
            await node.worker.run_once()
        [row] = await _held(db, alarm)
        assert server.on("/each") == [], "told at night of an alarm the night desk took"
        assert (row["status"], row["suppressed"]) == (
            "SUPPRESSED",
            "confirmed in quiet hours by night-desk",
        )
