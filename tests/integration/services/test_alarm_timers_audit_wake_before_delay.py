"""A timer pass that read its time just before a quiet window began, and finds an alarm that
the outbox publisher delayed just after it began (another node, or the same one): the pass
judged the window at a time before that delay, so it cannot wake it. Before, its wake wrote
woken_at before delayed_at, the domain refused the record (InvariantError, not a database
error), and the exception left the timers' loop: the daemon's task group went down with it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg

from gateway.alarms.delivery import hold
from gateway.alarms.lifecycle import create_alarm
from gateway.alarms.timers import AlarmTimers
from gateway.domain.quiet_hours import QuietHoursConfig, QuietWindowConfig, compile_quiet_hours
from tests.integration.services.test_alarm_timers import _at, _status

NIGHT = compile_quiet_hours(QuietHoursConfig(
    windows=[QuietWindowConfig(start="22:00", end="07:00", timezone="UTC")]
))  # fmt: skip
EVENING = datetime(2030, 1, 7, 21, 59, 58, tzinfo=UTC)


async def test_a_pass_from_before_the_window_leaves_an_alarm_delayed_after_it_held(
    pool: asyncpg.Pool,
) -> None:
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id="care-1", rule_key="r", severity="MAJOR",
            telemetry_event_id=f"{9:064x}", reason="test", node_id="n1", now=EVENING,
        )  # fmt: skip
        assert creation.alarm is not None
        alarm_id = creation.alarm.id
    # The publisher reaches it at 22:00:00.5, inside the window: DELAYED.
    delayed_at = EVENING + timedelta(seconds=2.5)
    async with pool.acquire() as conn, conn.transaction():
        assert await hold(conn, alarm_id, quiet=NIGHT, node_id="n2", now=delayed_at)
    # A pass that read its time at 21:59:59, before the window began (and before the delay).
    timers = AlarmTimers(
        pool=pool, node_id="n1", quiet=NIGHT, escalate_after_s=0, repeat_interval_s=0,
        clock=_at(EVENING + timedelta(seconds=1)),
    )  # fmt: skip
    report = await timers.run_once()
    assert report.woken == []
    assert await _status(pool, alarm_id) == "DELAYED"
    # The window's end wakes it, once.
    timers.clock = _at(datetime(2030, 1, 8, 7, 0, tzinfo=UTC))
    assert (await timers.run_once()).woken == [alarm_id]
    assert await _status(pool, alarm_id) == "NEW"
    async with pool.acquire() as conn:
        trail = await conn.fetch(
            "SELECT action FROM alarm_audit WHERE alarm_id = $1 ORDER BY id", alarm_id
        )
    assert [r["action"] for r in trail] == ["create", "delay", "wake"]
