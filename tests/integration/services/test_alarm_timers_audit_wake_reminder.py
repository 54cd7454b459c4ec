"""A night-held alarm is notified at its wake (alarm.woken releases its held notifications and
pushes it); its reminders count from that wake, as its unreached bound does: no reminder in the
same pass as the wake, one a repeat interval later (docs/behaviour.md §5, Reminders)."""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg

from gateway.alarms.delivery import hold
from gateway.alarms.lifecycle import create_alarm
from gateway.domain.quiet_hours import QuietHoursConfig, QuietWindowConfig, compile_quiet_hours
from tests.integration.services.test_alarm_timers import _passes_on_two_nodes


async def test_a_night_held_alarm_is_not_reminded_in_the_pass_that_wakes_it(
    pool: asyncpg.Pool,
) -> None:
    night = compile_quiet_hours(QuietHoursConfig(
        windows=[QuietWindowConfig(start="22:00", end="07:00", timezone="UTC")]
    ))  # fmt: skip
    raised = datetime(2030, 1, 7, 22, 30, tzinfo=UTC)
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id="care-1", rule_key="r", severity="MAJOR",
            telemetry_event_id=f"{7:064x}", reason="test", node_id="n1", now=raised,
        )  # fmt: skip
        assert creation.alarm is not None
        alarm_id = creation.alarm.id
        assert await hold(conn, alarm_id, quiet=night, node_id="n1", now=raised)

    woken: dict[datetime, list[int]] = {}
    reminded: dict[datetime, list[int]] = {}
    passes = _passes_on_two_nodes(
        pool, night, repeat_interval_s=600, start=raised,
        end=datetime(2030, 1, 8, 7, 10, tzinfo=UTC),
    )  # fmt: skip
    async for when, report in passes:
        if report.woken:
            woken[when] = report.woken
        if report.reminded:
            reminded[when] = report.reminded
    assert woken == {datetime(2030, 1, 8, 7, 0, tzinfo=UTC): [alarm_id]}
    # Woken (and notified) at 07:00: its first reminder is due at 07:10, not at 07:00 too.
    assert reminded == {datetime(2030, 1, 8, 7, 10, tzinfo=UTC): [alarm_id]}
    async with pool.acquire() as conn:
        events = await conn.fetch(
            "SELECT event_type FROM outbox_event WHERE aggregate_id = $1 ORDER BY id",
            str(alarm_id),
        )
    assert [e["event_type"] for e in events] == [
        "alarm.created", "alarm.status_changed", "alarm.woken", "alarm.reminder"
    ]  # fmt: skip
