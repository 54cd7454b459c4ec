"""The notifications quiet hours hold for a DELAYED alarm, when they are not to be sent.

A held notification waits for its alarm's wake (gateway.alarms.timers), which releases it.
It is recorded ``SUPPRESSED`` instead, never sent, when at the wake the alarm is shelved (or
was raised while its device was out of service), and when the alarm leaves DELAYED by another
step before the quiet hours end: a person confirmed or handled it (the night desk took it), or
a newer firing superseded it (whose own notification tells of the chain). The person the
notification was held for is not told, at the quiet hours' end, of an alarm somebody already
took (docs/notifications.md, Quiet hours). A held one in a group's window leaves the window,
recorded on its own; a window left empty is SUPPRESSED itself.
"""

from __future__ import annotations

import uuid
from datetime import datetime

import asyncpg
import msgspec
import structlog

from storage import alarms as repo
from storage import notify as notify_repo
from storage.audit import mark_lock_wait

log = structlog.get_logger(__name__)


async def suppress_held(
    conn: asyncpg.Connection, alarm_id: int, now: datetime, why: str
) -> list[str]:
    """In the caller's transaction: the alarm's held notifications (those not yet claimed,
    alone or in a group's window) recorded SUPPRESSED for ``why`` (logged as
    ``held_notifications_suppressed``); the receivers of those suppressed."""
    try:
        receivers = [
            *await repo.suppress_held_deliveries(conn, alarm_id, now, why),
            *await _suppress_in_windows(conn, alarm_id, now, why),
        ]
    except asyncpg.exceptions.LockNotAvailableError as exc:
        # A held notification's row (a consumer adding to its window, a node stopped while
        # claiming it) kept the step waiting: that row was held, not the alarm.
        mark_lock_wait(exc, "notify_delivery")
        raise
    if receivers:
        log.info(
            "held_notifications_suppressed",
            alarm_id=alarm_id,
            deliveries=len(receivers),
            suppressed=why,
        )
    return receivers


async def _suppress_in_windows(
    conn: asyncpg.Connection, alarm_id: int, now: datetime, why: str
) -> list[str]:
    """The alarm's notifications in group windows not yet claimed (a held window): each
    leaves its window and is recorded SUPPRESSED on its own, as the consumer records a
    suppressed notification of a grouped route (it joins no window); a window left empty is
    SUPPRESSED too, never sent. The receivers of the notifications suppressed."""
    rows = await repo.held_window_members(conn, alarm_id)
    if not rows:
        return []
    by_window: dict[int, list[uuid.UUID]] = {}
    deliveries: list[notify_repo.NewDelivery] = []
    for row in rows:
        by_window.setdefault(row["delivery_id"], []).append(row["event_id"])
        body = msgspec.json.decode(row["body"])
        deliveries.append(
            notify_repo.NewDelivery(
                event_id=row["event_id"],
                outbox_id=row["outbox_id"],
                event=body["event"],
                receiver=row["receiver"],
                body=body,
                alarm_id=alarm_id,
                device_id=body.get("device_id"),
                rule_key=body.get("rule_key"),
                severity=body.get("severity"),
                silence_id=None,
                due_in_s=0.0,
                event_created_at=datetime.fromisoformat(body["occurred_at"]),
                suppressed=why,
                route_grouped=True,  # taken out of a group's window
            )
        )
    for delivery_id, event_ids in by_window.items():
        status = await repo.drop_from_window(conn, delivery_id, event_ids, now, why)
        if status == "SUPPRESSED":
            log.info("held_window_emptied", delivery_id=delivery_id, suppressed=why)
    created = await notify_repo.insert_deliveries(conn, deliveries)
    return [r["receiver"] for r in created]
