"""An alarm reaching people (docs/behaviour.md §5): PUSHED means a person really received it.

Quiet hours are decided once per alarm, by :func:`hold`: the outbox publisher and the
notification consumer both call it, and the first to reach the NEW alarm decides (DELAYED, or
left NEW); notifications follow that stored decision. When its creation (or wake-up) event has
been published, the outbox publisher calls :func:`deliver`: inside quiet hours the alarm is
held back as DELAYED; otherwise it is pushed
only if that publish reached someone (an MQTT 5 PUBACK with reason code 0: there were
subscribers). A notification delivery that its receiver accepted pushes it too
(:func:`reached`, called by the delivery worker), and so does a console ``/stream`` session
that wrote the event to its client (:func:`reached_on_stream`, called by the stream hub for
every alarm its sessions wrote in a round). With none of these it stays NEW, and the alarm
timers count it unreached after ``[alarms] unreached_after_s``."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

import asyncpg

from gateway.alarms.lifecycle import AlarmNotFoundError, StatusChangedError, transition
from gateway.domain.alarm import Action, AlarmStatus
from gateway.domain.quiet_hours import QuietHours
from storage import alarms as repo

QUIET_ACTOR = "system:quiet-hours"
PUSH_ACTOR = "system:outbox"
NOTIFY_ACTOR = "system:notify"
STREAM_ACTOR = "system:stream"


async def hold(
    conn: asyncpg.Connection,
    alarm_id: int,
    *,
    quiet: QuietHours | None,
    node_id: str,
    now: datetime | None = None,
    deliveries_made: bool = False,
) -> bool:
    """Quiet hours, decided once per alarm: a NEW alarm inside quiet hours (and not of an
    exempt severity) goes DELAYED, in the caller's transaction; whether it did.

    Called by the outbox publisher and by the notification consumer, whichever reaches the
    alarm first; the alarm's row is locked while deciding, so one decides and the other finds
    the outcome. Notifications follow the stored decision: the consumer holds them while the
    alarm is DELAYED, and the wake releases them. So the publisher (``deliveries_made=False``)
    never holds an alarm whose notifications were made already: the consumer that made them
    decided, and a delivery of them may be on its way to a person.
    """
    if quiet is None:
        return False
    record = await repo.lock_new_alarm(conn, alarm_id)
    if record is None:
        return False
    at = now or await repo.db_now(conn)
    if not quiet.is_quiet(device_id=record["device_id"], severity=record["severity"], at=at):
        return False
    if not deliveries_made and await repo.has_deliveries(conn, alarm_id):
        return False
    try:
        await transition(
            conn,
            alarm_id,
            Action.DELAY,
            actor=QUIET_ACTOR,
            node_id=node_id,
            expected=AlarmStatus.NEW,
            now=at,
        )
    except (StatusChangedError, AlarmNotFoundError):
        return False
    return True


async def deliver(
    conn: asyncpg.Connection,
    alarm_id: int,
    *,
    quiet: QuietHours | None,
    node_id: str,
    reached: str | None = None,
    now: datetime | None = None,
) -> AlarmStatus | None:
    """The alarm's creation (or wake-up) event went out: hold it back, or push it.

    Inside quiet hours a NEW alarm goes DELAYED (:func:`hold`). Otherwise it is pushed only
    when ``reached`` names who the publish reached (the audit note); None: nobody was (no
    subscriber, or a 3.1.1 PUBACK, which cannot say), and it stays NEW. Conditional on still
    being NEW; None when nothing changed.
    """
    if await hold(conn, alarm_id, quiet=quiet, node_id=node_id, now=now):
        return AlarmStatus.DELAYED
    if reached is None:
        return None
    record = await repo.get(conn, alarm_id)
    if record is None or record["status"] != AlarmStatus.NEW.value:
        return None
    try:
        changed = await transition(
            conn,
            alarm_id,
            Action.PUSH,
            actor=PUSH_ACTOR,
            node_id=node_id,
            expected=AlarmStatus.NEW,
            now=now,
            note=f"reached via {reached}",
        )
    except (StatusChangedError, AlarmNotFoundError):
        return None
    return changed.status


async def reached(
    conn: asyncpg.Connection,
    alarm_id: int,
    *,
    via: str,
    node_id: str,
    actor: str = NOTIFY_ACTOR,
) -> bool:
    """A person-facing channel took the alarm (``via`` names it; ``actor`` is the one that saw
    it happen): a NEW alarm is pushed, in the caller's transaction. Conditional on still being
    NEW; False when it is not (pushed already, held back, or taken by a person)."""
    record = await repo.get(conn, alarm_id)
    if record is None or record["status"] != AlarmStatus.NEW.value:
        return False
    try:
        await transition(
            conn,
            alarm_id,
            Action.PUSH,
            actor=actor,
            node_id=node_id,
            expected=AlarmStatus.NEW,
            note=f"reached via {via}",
        )
    except (StatusChangedError, AlarmNotFoundError):
        return False
    return True


async def reached_on_stream(
    conn: asyncpg.Connection,
    written: Mapping[int, str],
    *,
    quiet: QuietHours | None,
    node_id: str,
) -> list[int]:
    """Console ``/stream`` sessions wrote the creation (or wake-up) event of these alarms to
    their clients (``written``: alarm id → what wrote it, for the audit note): those still NEW
    are pushed, each in its own transaction; the ids pushed.

    One statement finds which are still NEW (usually none: every session on every node writes
    the same events, and the first push wins). An alarm that quiet hours hold back is left to
    the outbox publisher, which holds it DELAYED: the console lists it, it does not ring. An
    alarm shelved now is not pushed either: the console leaves it out of its list."""
    if not written:
        return []
    rows = await repo.still_new(conn, sorted(written))
    if not rows:
        return []
    at = await repo.db_now(conn) if quiet is not None else None
    pushed: list[int] = []
    for row in rows:
        if (
            at is not None
            and quiet is not None
            and quiet.is_quiet(device_id=row["device_id"], severity=row["severity"], at=at)
        ):
            continue
        alarm_id = int(row["id"])
        async with conn.transaction():
            done = await reached(
                conn, alarm_id, via=written[alarm_id], node_id=node_id, actor=STREAM_ACTOR
            )
        if done:
            pushed.append(alarm_id)
    return pushed
