"""A step out of quiet hours (the wake, a person confirming) taken while a consumer is making
the alarm's notification: the consumer read the alarm DELAYED (so it held the notification,
due when its quiet hours would end, or in a day), and the step, committing before that
notification did, found nothing to release or suppress. The notification was then due hours
after its alarm was back to NEW (a reload that takes a quiet window away, the wake's usual
cause besides the window's end, paged nobody for a day), or still due at the quiet hours' end
for an alarm the night desk had taken."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from gateway.alarms.delivery import hold
from gateway.alarms.service import AlarmService
from gateway.alarms.timers import AlarmTimers
from gateway.domain.alarm import Action
from gateway.domain.quiet_hours import QuietHoursConfig, QuietWindowConfig, compile_quiet_hours
from tests.integration.services.test_notify import (
    Notifier,
    _config,
    _deliveries,
    _drain,
    _raised,
    _route,
    _webhook,
)
from tests.support.held_batch import lock_waiters
from tests.support.waiting import wait_until


async def _step_while_consuming(
    pool: asyncpg.Pool, dsn: str, db: asyncpg.Connection, step: Callable[[int], Awaitable[Any]]
) -> tuple[int, Any]:
    """A held alarm (a node's outbox publisher, under a quiet window, decided first: DELAYED,
    no notification yet); a consumer without the window (its reload took it away) reads it
    and, before it inserts the delivery, ``step`` is taken on the alarm. The alarm's id, and
    what ``step`` returned."""
    window = compile_quiet_hours(
        QuietHoursConfig(windows=[QuietWindowConfig(start="00:00", end="23:59")])
    )
    event_id, alarm_id = await _raised(db, "dev-1", "MAJOR")
    async with db.transaction():
        assert await hold(db, alarm_id, quiet=window, node_id="n0")
    config = _config(_webhook("hook", "http://127.0.0.1:9/h"), _route(["hook"]))
    node = Notifier(pool, dsn, config)
    # An uncommitted delivery of the event: the consumer's insert waits for it (the unique
    # key), after it read the alarm.
    blocker = await asyncpg.connect(dsn)
    tx = blocker.transaction()
    await tx.start()
    try:
        await blocker.execute(
            "INSERT INTO notify_delivery (event_id, outbox_id, event, receiver, body,"
            " event_created_at) VALUES ($1, 0, 'alarm.created', 'hook', '{}', now())",
            event_id,
        )
        consuming = asyncio.create_task(_drain(node.consumer))
        await wait_until(lambda: lock_waiters(dsn), message="consumer at its insert")
        stepping = asyncio.create_task(step(alarm_id))

        async def settled() -> bool:
            return stepping.done() or len(await lock_waiters(dsn)) >= 2

        # The step is done, or waits for the consumer's transaction.
        await wait_until(settled, message="step done or waiting")
    finally:
        await tx.rollback()
        await blocker.close()
    await asyncio.wait_for(consuming, 30)
    return alarm_id, await asyncio.wait_for(stepping, 30)


async def _delivery(db: asyncpg.Connection) -> asyncpg.Record:
    [row] = await _deliveries(db)
    return row


async def test_a_wake_while_the_consumer_makes_the_notification_leaves_it_due_at_once(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    timers = AlarmTimers(pool=pool, node_id="n1", quiet=None, escalate_after_s=0,
                         repeat_interval_s=0)  # fmt: skip
    alarm_id, report = await _step_while_consuming(
        pool, db_dsn, db, lambda _alarm: timers.run_once()
    )
    assert report.woken == [alarm_id]
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "NEW"
    row = await _delivery(db)
    now = await db.fetchval("SELECT now()")
    assert (row["status"], row["attempts"]) == ("PENDING", 0)
    # Due now: the alarm is NEW, nothing holds its notification any more.
    assert row["next_attempt_at"] <= now, (row["next_attempt_at"], now)


async def test_a_confirmation_while_the_consumer_makes_the_notification_suppresses_it(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    desk = AlarmService(pool, "n1")
    alarm_id, _ = await _step_while_consuming(
        pool, db_dsn, db, lambda alarm: desk.act(alarm, Action.CONFIRM, actor="night-desk")
    )
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "CONFIRMED"
    # Not sent when the quiet hours end: the night desk took the alarm.
    row = await _delivery(db)
    assert (row["status"], row["suppressed"]) == (
        "SUPPRESSED",
        "confirmed in quiet hours by night-desk",
    )
