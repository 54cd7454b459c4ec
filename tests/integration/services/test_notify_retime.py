"""Audit of the reload's re-timing of the stored groups (retime_groups) and of the sibling
rule of a group's repeat (group_open_members): two nodes, the real database."""

from __future__ import annotations

import asyncio

import asyncpg

from storage import notify as notify_repo
from tests.integration.services.test_notify_grouping import (
    ESCALATING,
    ONLY_GROUPED,
    _config,
    _consume_together,
    _escalated_by_day,
    _night_window_sent,
    _quiet_now,
    _raise,
    _reload,
    _sent_long_ago,
    _two_nodes,
    _window_status,
    _windows,
)
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until


async def test_a_reloads_retime_and_a_consumer_adding_to_two_groups_do_not_deadlock(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Group b made before group a (b's id the lower). A consumer (node one) adds a
    notification to each, in the order every node locks groups (receiver, key: a, then b);
    node two, just reloaded (a shorter repeat_interval_s), re-times the groups at its pass
    meanwhile. The retime must queue behind the consumer, not lock b and wait for a while
    the consumer waits for b: a deadlock aborts one of them (the reload's pass, or the
    consumer's transaction and every notification in it)."""
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            await _raise(db, "dev-0", "b", 0)
            await nodes[0].drain()
            await _raise(db, "dev-1", "a", 1)
            await nodes[0].drain()
            keys = await db.fetch("SELECT group_key FROM notify_group ORDER BY id")
            assert [k["group_key"] for k in keys] == ["routes[0]{rule=b}", "routes[0]{rule=a}"]
            shorter = ONLY_GROUPED.replace("repeat_interval_s = 3600", "repeat_interval_s = 600")
            consumer = await asyncpg.connect(db_dsn)
            try:
                tx = consumer.transaction()
                await tx.start()
                await notify_repo.lock_group(consumer, "hook", "routes[0]{rule=a}", {"rule": "a"})
                _reload(nodes[1], _config(server.url(""), shorter))
                reloaded = asyncio.create_task(nodes[1].consumer.run_once())
                await wait_until(
                    lambda: db.fetchval(
                        "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a "
                        "ON a.pid = l.pid WHERE a.datname = current_database() AND NOT l.granted "
                        "AND a.query LIKE '%the intervals a reload%')"
                    ),
                    message="the retime waits for the consumer's group",
                )
                await notify_repo.lock_group(consumer, "hook", "routes[0]{rule=b}", {"rule": "b"})
                await tx.commit()
            finally:
                await consumer.close()
            await reloaded
            rows = await db.fetch("SELECT repeat_interval_s FROM notify_group")
            assert {r["repeat_interval_s"] for r in rows} == {600}


async def test_an_alarm_whose_newest_notification_failed_in_the_sibling_is_still_repeated(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Alarm a is raised in quiet hours (its creation in the held window, sent at the wake)
    and escalated by day (the ordinary window), but the receiver is down when the day's
    window goes: it ends FAILED, and a group whose latest window failed repeats nothing. The
    held group must not leave a out for the ordinary group's sake then: nobody would remind
    the receiver of an open, escalated alarm (before the sibling rule the held group did)."""
    quiet = _quiet_now()
    # The night's window sent, the day's refused at every attempt (max_attempts = 5).
    async with webhook_server(hook=lambda k, _r: 500 if 1 <= k <= 5 else 200) as server:
        config = _config(
            server.url(""), ESCALATING.replace("group_wait_s = 60", "group_wait_s = 0")
        )
        async with _two_nodes(db_dsn, config) as nodes:
            a, night = await _night_window_sent(db, nodes, quiet)
            day = await _escalated_by_day(db, nodes, a)
            await wait_until(lambda: _window_status(db, day["id"], "FAILED"), message="failed")
            await _sent_long_ago(db, night["id"])
            await _consume_together(nodes)
            windows = await _windows(db)
            assert len(windows) == 3, "nobody repeats the open, escalated alarm"
            repeat = windows[-1]
            assert repeat["body"]["group_key"] == "routes[0]{rule=hot}|held"
            assert [n["alarm_id"] for n in repeat["body"]["notifications"]] == [a]
            await wait_until(lambda: _window_status(db, repeat["id"], "SENT"), message="sent")
        assert len(server.on("/hook")) == 7
