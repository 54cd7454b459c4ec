"""Retention of notification deliveries leaves a grouped route's reminders of open alarms going.

A group's repeat is made from its latest window (``notify_group.window_delivery_id``: sent when,
for which outbox event); what it lists is in ``notify_group_member``. Retention pruned that
window once it had ended ``notify_days`` ago, then the group (none of its deliveries left) with
its members: a route reminding of its open alarms less often than ``notify_days`` (a weekly
repeat, notify_days = 3 on a small disk) reminded once, never again, though the alarm stayed
open. Real PostgreSQL, a real webhook receiver, the real consumer, worker and maintenance."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import msgspec

from gateway.alarms.lifecycle import transition
from gateway.config import Config, RetentionConfig, parse_config
from gateway.domain.alarm import Action
from gateway.maintenance.runner import Maintenance
from gateway.notify.consumer import NotifyConsumer
from gateway.notify.metrics import NotifyMetrics
from gateway.notify.worker import DeliveryWorker
from gateway.support.metrics import Metrics
from storage.pool import create_pool
from tests.integration.services.test_notify_grouping import _raise, _window_status
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

WEEK_S = 7 * 86400


def _config(url: str) -> Config:
    return parse_config(
        f"""
[notify]
backoff_min_s = 0.01
backoff_max_s = 0.05
poll_s = 0.05

[[notify.receivers]]
name = "hook"
kind = "webhook"
url = "{url}/hook"

[[notify.routes]]
events = ["alarm.created"]
receivers = ["hook"]
group_by = ["rule"]
group_wait_s = 60
group_interval_s = 300
repeat_interval_s = {WEEK_S}
"""
    )


@contextlib.asynccontextmanager
async def _node(db_dsn: str, config: Config) -> AsyncIterator[NotifyConsumer]:
    pool = await create_pool(db_dsn, min_size=1, max_size=3)
    metrics = NotifyMetrics(Metrics().registry)
    rules = config.notify_rules()
    worker = DeliveryWorker(
        pool=pool, node_id="n1", metrics=metrics, settings=config.notify, rules=rules
    )
    consumer = NotifyConsumer(
        pool=pool, dsn=db_dsn, metrics=metrics, rules=rules, batch=config.notify.batch
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield consumer
    finally:
        stop.set()
        await task
        await pool.close()


async def _drain(consumer: NotifyConsumer) -> None:
    while await consumer.run_once():
        pass


async def _windows(db: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await db.fetch("SELECT * FROM notify_delivery WHERE event = 'notify.group' ORDER BY id")
    return [{**dict(r.items()), "body": msgspec.json.decode(r["body"])} for r in rows]


async def _first_window_sent_a_week_ago(
    db: asyncpg.Connection, consumer: NotifyConsumer
) -> dict[str, Any]:
    await _drain(consumer)
    [window] = await _windows(db)
    await db.execute(
        "UPDATE notify_delivery SET next_attempt_at = now() WHERE id = $1", window["id"]
    )
    await wait_until(lambda: _window_status(db, window["id"], "SENT"), message="the window sent")
    # A week on (the database's clock stamped it): the repeat is due, and the window ended
    # longer ago than notify_days.
    await db.execute(
        "UPDATE notify_delivery SET finished_at = finished_at - make_interval(secs => $2) "
        "WHERE id = $1",
        window["id"],
        WEEK_S + 1,
    )
    await db.execute(
        "UPDATE notify_group SET created_at = created_at - make_interval(secs => $1)",
        WEEK_S + 61,
    )
    return window


async def _retention(pool: asyncpg.Pool) -> dict[str, int]:
    report = await Maintenance(
        pool=pool, retention=RetentionConfig(notify_days=3), metrics=Metrics()
    ).run_once()
    assert report.ran
    return report.deleted


async def test_a_weekly_reminder_of_an_open_alarm_outlives_notify_days(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server() as server, _node(db_dsn, _config(server.url(""))) as consumer:
        alarm = await _raise(db, "dev-1", "hot", 1)
        first = await _first_window_sent_a_week_ago(db, consumer)

        await _retention(pool)
        await _drain(consumer)

        windows = await _windows(db)
        assert [w["id"] for w in windows[:1]] == [first["id"]], "the window was pruned"
        assert len(windows) == 2, "no reminder after retention"
        repeat = windows[-1]
        assert repeat["body"]["repeat"] is True
        assert [n["alarm_id"] for n in repeat["body"]["notifications"]] == [alarm]
        await db.execute(
            "UPDATE notify_delivery SET next_attempt_at = now() WHERE id = $1", repeat["id"]
        )
        await wait_until(
            lambda: _window_status(db, repeat["id"], "SENT"), message="the reminder sent"
        )
        assert len(server.on("/hook")) == 2


async def test_a_group_whose_alarms_are_all_dealt_with_is_still_pruned(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server() as server, _node(db_dsn, _config(server.url(""))) as consumer:
        alarm = await _raise(db, "dev-1", "hot", 1)
        first = await _first_window_sent_a_week_ago(db, consumer)
        async with db.transaction():
            await transition(db, alarm, Action.FALSE, actor="op", node_id="n0")
        await _drain(consumer)  # the repeat pass finds nothing open: the group stops

        deleted = await _retention(pool)

        assert deleted["notify_delivery"] == 1
        assert deleted["notify_group"] == 1
        assert await db.fetchval("SELECT count(*) FROM notify_group") == 0
        assert first["id"] not in [w["id"] for w in await _windows(db)]
