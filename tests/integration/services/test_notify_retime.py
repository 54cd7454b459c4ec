"""Audit of the reload's re-timing of the stored groups (retime_groups) and of the sibling
rule of a group's repeat (group_open_members): two nodes, the real database."""

from __future__ import annotations

import asyncio

import asyncpg

from storage import notify as notify_repo
from tests.integration.services.test_notify_grouping import (
    ONLY_GROUPED,
    _config,
    _raise,
    _reload,
    _two_nodes,
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
                        "ON a.pid = l.pid WHERE NOT l.granted AND a.query LIKE '%route positions%')"
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
