"""An alarm reaching people (docs/behaviour.md §5): PUSHED means a person really received it.

When its creation (or wake-up) event has been published, the outbox publisher calls
:func:`deliver`: inside quiet hours the alarm is held back as DELAYED; otherwise it is pushed
only if that publish reached someone (an MQTT 5 PUBACK with reason code 0: there were
subscribers). A notification delivery that its receiver accepted pushes it too
(:func:`reached`, called by the delivery worker). With neither it stays NEW, and the alarm
timers count it unreached after ``[alarms] unreached_after_s``."""

from __future__ import annotations

from datetime import datetime

import asyncpg

from gateway.alarms.service import (
    AlarmNotFoundError,
    StatusChangedError,
    transition,
)
from gateway.domain.alarm import Action, AlarmStatus
from gateway.domain.quiet_hours import QuietHours
from storage import alarms as repo

QUIET_ACTOR = "system:quiet-hours"
PUSH_ACTOR = "system:outbox"
NOTIFY_ACTOR = "system:notify"


async def deliver(
    conn: asyncpg.Connection,
    alarm_id: int,
    *,
    quiet: QuietHours | None,
    node_id: str,
    reached: str | None = None,
    now: datetime | None = None,
) -> AlarmStatus | None:
    """The alarm's creation (or wake-up) event went out: push it, or hold it back.

    Inside quiet hours (and not of an exempt severity) a NEW alarm goes DELAYED instead of
    PUSHED. Otherwise it is pushed only when ``reached`` names who the publish reached (the
    audit note); None: nobody was (no subscriber, or a 3.1.1 PUBACK, which cannot say), and it
    stays NEW. Conditional on still being NEW; None when nothing changed.
    """
    record = await repo.get(conn, alarm_id)
    if record is None or record["status"] != AlarmStatus.NEW.value:
        return None
    at = now or await repo.db_now(conn)
    held = quiet is not None and quiet.is_quiet(
        device_id=record["device_id"], severity=record["severity"], at=at
    )
    if not held and reached is None:
        return None
    action, actor = (Action.DELAY, QUIET_ACTOR) if held else (Action.PUSH, PUSH_ACTOR)
    try:
        changed = await transition(
            conn,
            alarm_id,
            action,
            actor=actor,
            node_id=node_id,
            expected=AlarmStatus.NEW,
            now=at,
            note=None if held else f"reached via {reached}",
        )
    except (StatusChangedError, AlarmNotFoundError):
        return None
    return changed.status


async def reached(conn: asyncpg.Connection, alarm_id: int, *, via: str, node_id: str) -> bool:
    """A notification of the alarm was accepted by its receiver (``via`` names it): a NEW alarm
    is pushed, in the caller's transaction. Conditional on still being NEW; False when it is not
    (pushed already, held back, or taken by a person)."""
    record = await repo.get(conn, alarm_id)
    if record is None or record["status"] != AlarmStatus.NEW.value:
        return False
    try:
        await transition(
            conn,
            alarm_id,
            Action.PUSH,
            actor=NOTIFY_ACTOR,
            node_id=node_id,
            expected=AlarmStatus.NEW,
            note=f"reached via {via}",
        )
    except (StatusChangedError, AlarmNotFoundError):
        return False
    return True
