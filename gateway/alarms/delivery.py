"""An alarm reaching people: when its creation (or wake-up) event has been published, it is
pushed — or, inside quiet hours, held back as DELAYED. The outbox publisher calls this."""

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


async def deliver(
    conn: asyncpg.Connection,
    alarm_id: int,
    *,
    quiet: QuietHours | None,
    node_id: str,
    now: datetime | None = None,
) -> AlarmStatus | None:
    """The alarm's creation (or wake-up) event went out: push it, or hold it back.

    Inside quiet hours (and not of an exempt severity) a NEW alarm goes DELAYED instead of
    PUSHED. Conditional on still being NEW; None when it is not (a person took it first).
    """
    record = await repo.get(conn, alarm_id)
    if record is None or record["status"] != AlarmStatus.NEW.value:
        return None
    at = now or await repo.db_now(conn)
    held = quiet is not None and quiet.is_quiet(
        device_id=record["device_id"], severity=record["severity"], at=at
    )
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
        )
    except (StatusChangedError, AlarmNotFoundError):
        return None
    return changed.status
