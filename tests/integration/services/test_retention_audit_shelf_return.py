"""Retention of notification deliveries leaves a long shelf's end able to tell its alarms.

When a shelf ends, each alarm it kept quiet that still stands is told again on the routes that
do not group, from its newest notification a shelf suppressed (``shelf_returns``: the SUPPRESSED
``notify_delivery`` row is what is sent again). Retention pruned that row as any ended
delivery once it was ``notify_days`` old: an alarm raised under a shelf longer than
``notify_days`` (a week's shelf, or a daily shelf renewed for a week, with ``notify_days = 3``
on a small disk) came back from the shelf silently, though it still stood: ISA-18.2's return to
annunciation lost, and the alarm never pushed. Real PostgreSQL, real webhook receivers, the real
consumers, workers, alarm timers and maintenance pass."""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.alarms.lifecycle import transition
from gateway.domain.alarm import Action
from tests.integration.services.test_maintenance_notify_groups import _retention
from tests.integration.services.test_notify_grouping import _consume_together, _two_nodes
from tests.integration.services.test_notify_shelf_end import (
    _config,
    _deliveries,
    _got,
    _no_more_than_once_each,
    _past_its_until,
    _raise,
    _returns,
    _shelve_pair,
    _timers,
)
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

DAYS_AGO = 4  # the notifications suppressed that long ago; notify_days = 3


async def _suppressed_days_ago(db: asyncpg.Connection, alarm_id: int, shelf_id: int) -> None:
    """The alarm's suppressed notifications, and the shelf, date from DAYS_AGO days back (the
    database's clock stamped them; as if the shelf had stood that long)."""
    await db.execute(
        "UPDATE notify_delivery SET finished_at = finished_at - make_interval(days => $2),"
        " created_at = created_at - make_interval(days => $2),"
        " event_created_at = event_created_at - make_interval(days => $2)"
        " WHERE alarm_id = $1",
        alarm_id,
        DAYS_AGO,
    )
    await db.execute(
        "UPDATE alarm_shelf SET shelved_at = shelved_at - make_interval(days => $2) WHERE id = $1",
        shelf_id,
        DAYS_AGO,
    )


async def test_an_alarm_shelved_longer_than_notify_days_is_told_when_its_shelf_ends(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        shelf_id = await _shelve_pair(db, "pump-1")
        alarm_id = await _raise(db, "pump-1")
        await _consume_together(nodes)
        assert {d["status"] for d in await _deliveries(db, alarm_id)} == {"SUPPRESSED"}
        await _suppressed_days_ago(db, alarm_id, shelf_id)

        await _retention(pool)
        await _past_its_until(db, shelf_id)
        reports = await asyncio.gather(
            *(_timers(node, f"n{k}").run_once() for k, node in enumerate(nodes, 1))
        )

        assert sorted(s for r in reports for s in r.unshelved) == [shelf_id]
        returns = await _returns(db, alarm_id)
        assert sorted(d["receiver"] for d in returns) == ["each", "hook"], (
            "the alarm the shelf kept quiet came back from it untold: its suppressed "
            "notifications were pruned by retention while it stood"
        )
        await wait_until(lambda: _got(server, "/hook", "/each"), message="both told once")
        await _no_more_than_once_each(nodes, server)


async def test_a_return_told_is_not_told_again_after_retention(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """The newest notification of a standing alarm stays, whatever it is: pruned, the return
    told days ago would leave the suppressed one before it as the newest, and the next shelf's
    end over the alarm would tell it a second time."""
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        shelf_id = await _shelve_pair(db, "pump-1")
        alarm_id = await _raise(db, "pump-1")
        await _consume_together(nodes)
        await _past_its_until(db, shelf_id)
        await _timers(nodes[0], "n1").run_once()
        await wait_until(lambda: _got(server, "/hook", "/each"), message="the return told")
        await wait_until(
            lambda: _all_ended(db, alarm_id), message="every delivery of the alarm ended"
        )
        await _suppressed_days_ago(db, alarm_id, shelf_id)
        await _retention(pool)

        again = await _shelve_pair(db, "pump-1")
        await _past_its_until(db, again)
        await _timers(nodes[0], "n1").run_once()
        await _no_more_than_once_each(nodes, server)
        assert len(await _returns(db, alarm_id)) == 2  # the first end's, on hook and each


async def _all_ended(db: asyncpg.Connection, alarm_id: int) -> bool:
    return not await db.fetchval(
        "SELECT count(*) FROM notify_delivery WHERE alarm_id = $1"
        " AND status IN ('PENDING', 'SENDING')",
        alarm_id,
    )


async def test_the_notifications_of_an_alarm_dealt_with_are_still_pruned(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        shelf_id = await _shelve_pair(db, "pump-1")
        alarm_id = await _raise(db, "pump-1")
        await _consume_together(nodes)
        await _suppressed_days_ago(db, alarm_id, shelf_id)
        async with db.transaction():
            await transition(db, alarm_id, Action.FALSE, actor="op", node_id="n0")

        deleted = await _retention(pool)

        assert deleted["notify_delivery"] == 3
        assert await _deliveries(db, alarm_id) == []
        assert not server.on("/hook")
