"""Shelving (ISA-18.2) and out of service: attributes around the nine states, never a status.

A shelf takes one alarm, or every alarm of a (device, rule) pair, present and future, off the
main view and keeps its notifications from being sent, for a bounded time, with a reason. It
ends by itself at its ``until`` (:func:`expire_due`, run by the alarm timers on every node: a
conditional write, so a shelf ends once however many nodes race) or earlier when a person lifts
it. Every step writes an audit row on each alarm it concerns (the shelved alarm, or the pair's
open alarms), in the step's transaction. A shelf's end also owes a repeat to the notification
groups that carried its alarms still open (docs/notifications.md, "Repeat"), and tells the
routes that do not group of each alarm it kept quiet that still stands, once
(:func:`tell_returned`; docs/notifications.md, "A shelf's end tells its alarms again").

Out of service is a device's maintenance period: its alarms are raised as ever, their
notifications suppressed (the notify consumer reads both, docs/notifications.md).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Final

import asyncpg
import msgspec
import structlog

from gateway.alarms.lifecycle import AlarmNotFoundError
from gateway.domain.alarm import AlarmError
from gateway.domain.notify import Silence, first_silence, silence_from_row
from gateway.domain.notify_match import Facts
from protocol.events import Aggregate, DeviceServiceChanged, EventType, ShelfChanged
from storage import alarms as alarm_repo
from storage import desk as repo
from storage import notify as notify_repo
from storage import outbox
from storage.desk import Scope

log = structlog.get_logger(__name__)

SHELF_ACTOR: Final = "system:shelving"
# The ids of the notifications a shelf's end sends (one per alarm, the same for every receiver:
# X-Gateway-Event-Id, what receivers deduplicate on) are derived from the shelf and the alarm.
RETURN_NAMESPACE: Final = uuid.UUID("6c1f4a52-2f0e-4f55-9a57-5d0b8e3e51a7")
# What the shelf and maintenance-period events carry of their rows: the API's fields
# (gateway.api.schemas Shelf and OutOfService), so a console reads the same shape either way.
_SHELF_FIELDS: Final = (
    "id", "scope", "alarm_id", "device_id", "rule_key", "reason", "shelved_by", "shelved_at",
    "until", "ended_at", "ended_by", "end_reason", "request_id",
)  # fmt: skip
_PERIOD_FIELDS: Final = (
    "id", "device_id", "reason", "set_by", "since", "until", "ended_at", "ended_by",
    "request_id",
)  # fmt: skip
_ALARM_TIMES: Final = (
    "triggered_at", "pushed_at", "confirmed_at", "escalated_at", "handled_at", "closed_at",
    "cleared_at",
)  # fmt: skip


class ShelfNotFoundError(AlarmError):
    code = "NOT_FOUND"

    def __init__(self, shelf_id: int) -> None:
        super().__init__(f"no shelf {shelf_id}")
        self.shelf_id = shelf_id


class AlreadyShelvedError(AlarmError):
    """A shelf in force covers the same alarm (or pair) already (HTTP 409)."""

    code = "ALREADY_SHELVED"

    def __init__(self, shelf: asyncpg.Record) -> None:
        what = (
            f"alarm {shelf['alarm_id']}"
            if shelf["scope"] == "alarm"
            else f"{shelf['rule_key']} on {shelf['device_id']}"
        )
        super().__init__(f"{what} is shelved already (shelf {shelf['id']}, until {shelf['until']})")
        self.shelf_id = int(shelf["id"])


class ShelfEndedError(AlarmError):
    """Lifting a shelf that ended already (lifted, or past its until) (HTTP 409)."""

    code = "SHELF_ENDED"

    def __init__(self, shelf_id: int) -> None:
        super().__init__(f"shelf {shelf_id} has ended already")
        self.shelf_id = shelf_id


class ShelfTooLongError(AlarmError):
    """A shelf longer than ``[alarms] shelve_max_s`` (HTTP 400)."""

    code = "SHELF_TOO_LONG"

    def __init__(self, seconds: float, limit: float) -> None:
        super().__init__(f"a shelf of {seconds:g} s is longer than the limit, {limit:g} s")
        self.seconds = seconds
        self.limit = limit


class DeviceNotFoundError(AlarmError):
    code = "NOT_FOUND"

    def __init__(self, device_id: str) -> None:
        super().__init__(f"no device {device_id}")
        self.device_id = device_id


class NotOutOfServiceError(AlarmError):
    """Ending a maintenance period where none is in force (HTTP 409)."""

    code = "NOT_OUT_OF_SERVICE"

    def __init__(self, device_id: str) -> None:
        super().__init__(f"device {device_id} is not out of service")
        self.device_id = device_id


class UntilPastError(AlarmError):
    """An out-of-service period ending before it starts (HTTP 400)."""

    code = "UNTIL_PAST"

    def __init__(self, until: datetime) -> None:
        super().__init__(f"until {until.isoformat()} is not in the future")
        self.until = until


def _until_note(shelf: asyncpg.Record) -> str:
    scope = "this alarm" if shelf["scope"] == "alarm" else f"{shelf['rule_key']} on this device"
    return f"shelf {shelf['id']} ({scope}) until {shelf['until'].isoformat()}: {shelf['reason']}"


async def shelve(
    conn: asyncpg.Connection,
    *,
    scope: Scope,
    alarm_id: int | None,
    device_id: str | None,
    rule_key: str | None,
    seconds: float,
    reason: str,
    actor: str,
    node_id: str,
    request_id: str | None,
) -> asyncpg.Record:
    """Shelve, in the caller's transaction: the shelf row and its audit rows, or nothing.

    ``scope`` "alarm" shelves ``alarm_id``; "pair" shelves (``device_id``, ``rule_key``), or
    the pair of ``alarm_id`` when given. A shelf of the same target past its until that the
    timer has not ended yet is ended first (as the timer would, audited). If it ended
    meanwhile (a timer's pass, or another request renewing it, ended it first), what is in
    the way is read again: another request's new shelf refuses this one (naming that shelf);
    none, and this one is made.
    """
    if alarm_id is not None:
        target = await repo.shelf_target(conn, alarm_id)
        if target is None:
            raise AlarmNotFoundError(alarm_id)
        device_id, rule_key = target["device_id"], target["rule_key"]
    assert device_id is not None
    assert rule_key is not None
    shelf_alarm = alarm_id if scope == "alarm" else None
    stale = await repo.open_shelf(
        conn, scope=scope, alarm_id=shelf_alarm, device_id=device_id, rule_key=rule_key
    )
    if stale is not None:
        ended = await repo.expire_shelf(conn, stale["id"], SHELF_ACTOR)
        if ended is not None:
            # Renewed at once: its alarms stay shelved, so nothing returns to annunciation
            # now; what it suppressed is told at the new shelf's end (shelf_returns).
            await _audit_end(
                conn, ended, actor=SHELF_ACTOR, node_id=node_id, request_id=None, renewed=True
            )
        else:
            # In force (not past its until), or ended by another transaction since it was
            # read (the timer ending it, settled and audited there; or another request
            # renewing it): only a shelf not ended now is in the way.
            current = await repo.open_shelf(
                conn, scope=scope, alarm_id=shelf_alarm, device_id=device_id, rule_key=rule_key
            )
            if current is not None:
                raise AlreadyShelvedError(current)
    shelf = await repo.insert_shelf(
        conn,
        scope=scope,
        alarm_id=shelf_alarm,
        device_id=device_id,
        rule_key=rule_key,
        reason=reason,
        by=actor,
        seconds=seconds,
        node_id=node_id,
        request_id=request_id,
    )
    if shelf is None:  # another request shelved it meanwhile
        current = await repo.open_shelf(
            conn, scope=scope, alarm_id=shelf_alarm, device_id=device_id, rule_key=rule_key
        )
        assert current is not None
        raise AlreadyShelvedError(current)
    alarm_ids = await repo.audit_shelf_step(
        conn,
        shelf,
        actor=actor,
        action="shelve",
        note=_until_note(shelf),
        request_id=request_id,
        node_id=node_id,
    )
    await _shelf_event(conn, EventType.SHELF_STARTED, shelf, alarm_ids, actor)
    return shelf


async def lift(
    conn: asyncpg.Connection, shelf_id: int, *, actor: str, node_id: str, request_id: str | None
) -> tuple[asyncpg.Record, bool]:
    """Lift a shelf in force, in the caller's transaction, audited: the shelf, and True.

    A shelf past its until that no node's timers ended yet is not in force: it is ended as
    they would end it (at its until, by system:shelving, audited, its alarms told again),
    and returned with False, so that the caller, once this transaction commits, refuses the
    lift (SHELF_ENDED) and a read of the shelf after that answer shows it ended. One ended
    already, however, is returned with False as it is."""
    ended = await repo.lift_shelf(conn, shelf_id, actor)
    if ended is not None:
        await _audit_end(conn, ended, actor=actor, node_id=node_id, request_id=request_id)
        return ended, True
    shelf = await repo.get_shelf(conn, shelf_id)
    if shelf is None:
        raise ShelfNotFoundError(shelf_id)
    if shelf["ended_at"] is None:
        expired = await repo.expire_shelf(conn, shelf_id, SHELF_ACTOR)
        if expired is not None:
            await _audit_end(conn, expired, actor=SHELF_ACTOR, node_id=node_id, request_id=None)
            return expired, False
        # A timer ended it meanwhile (the update waited for it, then found it ended).
    return shelf, False


async def _audit_end(
    conn: asyncpg.Connection,
    shelf: asyncpg.Record,
    *,
    actor: str,
    node_id: str,
    request_id: str | None,
    renewed: bool = False,
) -> list[int]:
    how = "lifted" if shelf["end_reason"] == "lifted" else "expired"
    if not renewed:
        # Another end over the same alarms (its own shelf and its pair's) is settled first,
        # or waits for this one: the later sees the earlier (expire_due holds its page's).
        await notify_repo.hold_shelf_ends(conn, [shelf])
    # Its alarms still open return to annunciation: the grouped routes' groups that carried
    # them are owed a repeat (gateway.notify.groups), recorded with the end, so once.
    await notify_repo.resume_groups(conn, int(shelf["id"]))
    # ... and the routes that do not group tell those the shelf kept quiet, once.
    if not renewed:
        await tell_returned(conn, shelf)
    alarm_ids = await repo.audit_shelf_step(
        conn,
        shelf,
        actor=actor,
        action="unshelve",
        note=f"shelf {shelf['id']} {how}",
        request_id=request_id,
        node_id=node_id,
    )
    await _shelf_event(conn, EventType.SHELF_ENDED, shelf, alarm_ids, actor)
    return alarm_ids


async def _shelf_event(
    conn: asyncpg.Connection,
    event_type: EventType,
    shelf: asyncpg.Record,
    alarm_ids: list[int],
    actor: str,
) -> None:
    """The step's event, in its transaction: other operators' consoles learn of it at once
    (the live stream), not at their next read (behaviour §5, "Shelving")."""
    await outbox.add_event(
        conn,
        aggregate_type=Aggregate.SHELF,
        aggregate_id=str(shelf["id"]),
        event_type=event_type,
        payload=ShelfChanged(
            shelf={key: shelf[key] for key in _SHELF_FIELDS},
            alarm_ids=sorted(alarm_ids),
            actor=actor,
        ),
    )


async def _service_event(
    conn: asyncpg.Connection, event_type: EventType, period: asyncpg.Record, actor: str
) -> None:
    await outbox.add_event(
        conn,
        aggregate_type=Aggregate.DEVICE,
        aggregate_id=str(period["device_id"]),
        event_type=event_type,
        payload=DeviceServiceChanged(
            device_id=str(period["device_id"]),
            period={key: period[key] for key in _PERIOD_FIELDS},
            actor=actor,
        ),
    )


async def tell_returned(conn: asyncpg.Connection, shelf: asyncpg.Record) -> list[int]:
    """ISA-18.2: an unshelved alarm returns to annunciation. In the transaction that ended the
    shelf (decided once, however many nodes race): each alarm the shelf covered that still
    stands (open, not cleared, shelved by no other shelf, not raised while its device was out
    of service) gets, on each receiver an ungrouped route chose for it whose newest
    notification of it a shelf suppressed (this one, or one this shelf renewed or overlapped),
    that notification delivered once now: its body as the consumer made it, with the alarm's
    status and times as they are now, a new event id, and ``returned_from_shelf`` saying
    which shelf ended, when and how. A silence in force now makes it SILENCED; quiet hours
    hold it as any delivery of its alarm (a DELAYED alarm's until its wake, which judges it
    again). The ids of the deliveries made.
    Also called by the notify consumer for a shelf that ended before it read a notification
    written under it."""
    rows = await notify_repo.shelf_returns(conn, int(shelf["id"]))
    if not rows:
        return []
    ended_at: datetime = shelf["ended_at"]
    # A silence in force now stops it as it stops any notification (SILENCED, never sent).
    now = await alarm_repo.db_now(conn)
    silences = [silence_from_row(s) for s in await notify_repo.active_silences(conn)]
    deliveries = [
        notify_repo.NewDelivery(
            event_id=_return_event_id(int(shelf["id"]), int(row["alarm_id"])),
            outbox_id=row["outbox_id"],
            event=row["event"],
            receiver=row["receiver"],
            body=_returned_body(row, shelf),
            alarm_id=row["alarm_id"],
            device_id=row["device_id"],
            rule_key=row["rule_key"],
            severity=row["severity"],
            silence_id=_silence_id(silences, row, now),
            due_in_s=0.0,
            # When the shelf ended, and never before what it returns: an expiry is dated at
            # its until, which a late timer may see after another shelf over the alarm
            # suppressed a newer notification; the return must be the newest afterwards, or
            # that shelf's end tells it again.
            event_created_at=max(ended_at, row["event_created_at"]),
            route_grouped=False,
        )
        for row in rows
    ]
    created = await notify_repo.insert_deliveries(conn, deliveries)
    log.info(
        "shelf_end_notifications",
        shelf_id=shelf["id"],
        end_reason=shelf["end_reason"],
        alarms=len({row["alarm_id"] for row in rows}),
        deliveries=len(created),
    )
    return [int(r["id"]) for r in created]


def _silence_id(silences: list[Silence], row: asyncpg.Record, now: datetime) -> int | None:
    facts = Facts(event=row["event"], device_id=row["device_id"], rule_key=row["rule_key"],
                  severity=row["severity"], alarm_id=row["alarm_id"])  # fmt: skip
    silence = first_silence(silences, facts, now)
    return None if silence is None else silence.id


def _return_event_id(shelf_id: int, alarm_id: int) -> uuid.UUID:
    return uuid.uuid5(RETURN_NAMESPACE, f"shelf {shelf_id} alarm {alarm_id}")


def _returned_body(row: asyncpg.Record, shelf: asyncpg.Record) -> dict[str, Any]:
    """The suppressed notification's body as the receiver would have had it, the alarm as it
    stands now, and what marks it a return from the shelf (docs/notifications.md)."""
    body: dict[str, Any] = msgspec.json.decode(row["body"])
    body["event_id"] = str(_return_event_id(int(shelf["id"]), int(row["alarm_id"])))
    body["status"] = row["status"]
    body["times"] = {key: row[key].isoformat() for key in _ALARM_TIMES if row[key] is not None}
    body["returned_from_shelf"] = {
        "shelf_id": int(shelf["id"]),
        "end_reason": shelf["end_reason"],
        "ended_at": shelf["ended_at"].isoformat(),
        "ended_by": shelf["ended_by"],
        "suppressed_event_id": str(row["event_id"]),
    }
    return body


async def expire_due(
    conn: asyncpg.Connection, now: datetime, *, node_id: str, limit: int
) -> list[asyncpg.Record]:
    """End the shelves past their until (at most ``limit``), each in this one transaction of
    the caller's with its audit rows; the shelves this call ended."""
    ended = await repo.expire_due(conn, now, SHELF_ACTOR, limit)
    # All the page's pairs at once, in key order (two nodes' pages never wait in a circle).
    await notify_repo.hold_shelf_ends(conn, ended)
    for shelf in ended:
        await _audit_end(conn, shelf, actor=SHELF_ACTOR, node_id=node_id, request_id=None)
    return ended


async def set_out_of_service(
    conn: asyncpg.Connection,
    device_id: str,
    *,
    reason: str,
    until: datetime | None,
    actor: str,
    request_id: str | None,
) -> asyncpg.Record:
    """Put the device out of service (a period already in force ends now, replaced).

    Another request may put it out of service at the same time: its period, committed after
    this one looked for a period to end, is in the way of the insert (which waits for it).
    It is replaced as any period in force is: ended, and the insert tried again. Each round
    ends a period committed since the last, so concurrent requests end one after the other,
    each replacing the one before (docs/api.md, "The alarm desk")."""
    if not await repo.device_known(conn, device_id):
        raise DeviceNotFoundError(device_id)
    if not await repo.until_ahead(conn, until):
        assert until is not None
        raise UntilPastError(until)
    while True:
        await repo.end_open_period(conn, device_id, actor)
        period = await repo.insert_period(
            conn, device_id=device_id, reason=reason, by=actor, until=until, request_id=request_id
        )
        if period is not None:
            await _service_event(conn, EventType.DEVICE_OUT_OF_SERVICE, period, actor)
            return period


async def end_out_of_service(
    conn: asyncpg.Connection, device_id: str, *, actor: str
) -> asyncpg.Record:
    """End the period in force now. One that another request put in force while this one
    waited for it (replacing the period this one found) is the period in force: it is the one
    ended, not refused as none."""
    if not await repo.device_known(conn, device_id):
        raise DeviceNotFoundError(device_id)
    while True:
        ended = await repo.end_period_in_force(conn, device_id, actor)
        if ended is not None:
            await _service_event(conn, EventType.DEVICE_IN_SERVICE, ended, actor)
            return ended
        if await repo.period_in_force(conn, device_id) is None:
            raise NotOutOfServiceError(device_id)
