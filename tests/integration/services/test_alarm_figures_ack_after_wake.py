"""Time to acknowledge counts from the wake for an alarm quiet hours held through the night.

A care home's quiet hours, 22:00-07:00, hold WARNING alarms DELAYED: on purpose, they ring
nobody until the window ends (behaviour §5). The day desk confirms a bed sensor's alarm raised
at 22:30 two minutes after it rang at 07:00; the figures said it took 8.5 hours (30,720 s), and
the night's held alarms alone drew the median and the 90th percentile red. Unreached alarms are
already measured from the wake for the same reason ("held on purpose, it could reach nobody
before"). One the night desk took while it was still held (listed, not ringing) counts from its
trigger, as any. Real PostgreSQL; the history is written with chosen times, as every figures
test writes it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg

from gateway.alarms.figures import AlarmFigures
from gateway.config import AlarmFiguresConfig
from tests.support.alarm_history import audit, raise_alarm

NOW = datetime(2026, 3, 3, 12, 0, tzinfo=UTC)


def at(hh: int, mm: int, *, day: int = 3) -> datetime:
    return datetime(2026, 3, day, hh, mm, tzinfo=UTC)


async def _held(
    db: asyncpg.Connection, device: str, raised: datetime, woken: datetime | None
) -> int:
    """An alarm quiet hours held DELAYED from ``raised``, woken (NEW again) at ``woken``."""
    alarm_id = await raise_alarm(db, "bed-exit", device, raised)
    await db.execute(
        "UPDATE alarm SET status = $2, delayed_at = $3, woken_at = $4 WHERE id = $1",
        alarm_id, "DELAYED" if woken is None else "NEW", raised, woken,
    )  # fmt: skip
    await audit(db, alarm_id, "system:quiet-hours", action="delay", from_status="NEW",
                to_status="DELAYED", at=raised)  # fmt: skip
    if woken is not None:
        await audit(db, alarm_id, "system:quiet-hours", action="wake", from_status="DELAYED",
                    to_status="NEW", at=woken)  # fmt: skip
    return alarm_id


async def _confirm(db: asyncpg.Connection, alarm_id: int, actor: str, when: datetime) -> None:
    status = await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id)
    await db.execute(
        "UPDATE alarm SET status = 'CONFIRMED', confirmed_at = $2, confirmed_by = $3 "
        "WHERE id = $1",
        alarm_id, when, actor,
    )  # fmt: skip
    await audit(db, alarm_id, actor, action="confirm", from_status=status,
                to_status="CONFIRMED", at=when)  # fmt: skip


async def test_an_alarm_held_through_the_night_is_acknowledged_from_its_wake(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    # Rang at its wake, 07:00, confirmed at 07:02: 120 s.
    morning = await _held(db, "bed-12", at(22, 30, day=2), woken=at(7, 0))
    await _confirm(db, morning, "day desk", at(7, 2))
    # Taken by the night desk while still held (no wake): 300 s after it was raised.
    night = await _held(db, "bed-14", at(23, 0, day=2), woken=None)
    await _confirm(db, night, "night desk", at(23, 5, day=2))
    # Never held (CRITICAL is exempt): 60 s.
    await raise_alarm(db, "smoke", "smoke-3", at(6, 0), severity="CRITICAL",
                      actions=(("confirm", "day desk", at(6, 1)),))  # fmt: skip

    report = await AlarmFigures(pool, AlarmFiguresConfig(), clock=lambda: NOW).report(
        timedelta(days=1)
    )
    assert report["acknowledgement"] == {
        "acknowledged": 3, "median_s": 120.0, "p90_s": 264.0, "max_s": 300.0,
    }  # fmt: skip
    desks = {o["actor"]: o["ack_median_s"] for o in report["operators"]}
    assert desks == {"day desk": 90.0, "night desk": 300.0}
