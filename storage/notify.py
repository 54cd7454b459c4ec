"""Notifications: the consumer's horizon, deliveries (claimed with a lease, finished by a
conditional write) and silences."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from storage.sql import load_queries

_Q = load_queries("notify.sql")
ENSURE_CONSUMER = _Q["ensure_consumer"]
READ_HORIZON = _Q["read_horizon"]
SKIP_HORIZON = _Q["skip_horizon"]
SCAN_UNCONSUMED = _Q["scan_unconsumed"]
CONSUME_EVENTS = _Q["consume_events"]
ADVANCE_HORIZON = _Q["advance_horizon"]
ALARM_FACTS = _Q["alarm_facts"]
LOCK_HELD_ALARMS = _Q["lock_held_alarms"]
ACTIVE_SILENCES = _Q["active_silences"]
INSERT_DELIVERIES = _Q["insert_deliveries"]
CLAIM_DUE = _Q["claim_due"]
FINISH_SENT = _Q["finish_sent"]
FINISH_RETRY = _Q["finish_retry"]
FINISH_PARTLY = _Q["finish_partly"]
FINISH_FAILED = _Q["finish_failed"]
WAKE_DEFERRING_GROUPS = _Q["wake_deferring_groups"]
PENDING_STATS = _Q["pending_stats"]
INSERT_SILENCE = _Q["insert_silence"]
LIST_SILENCES = _Q["list_silences"]
GET_SILENCE = _Q["get_silence"]
EXPIRE_SILENCE = _Q["expire_silence"]
LIST_DELIVERIES = _Q["list_deliveries"]
OPEN_ALARMS_OF_RULES = _Q["open_alarms_of_rules"]
LOCK_GROUP = _Q["lock_group"]
OPEN_WINDOW = _Q["open_window"]
APPEND_TO_WINDOW = _Q["append_to_window"]
INSERT_WINDOW = _Q["insert_window"]
SET_WINDOW = _Q["set_window"]
ADD_MEMBER = _Q["add_member"]
REPEAT_DUE = _Q["repeat_due"]
STOP_REPEATING = _Q["stop_repeating"]
GROUPS_TO_RETIME = _Q["groups_to_retime"]
RETIME_GROUPS = _Q["retime_groups"]
WAKE_STOPPED_GROUPS = _Q["wake_stopped_groups"]
ROUTE_CARRIES_ALARM = _Q["route_carries_alarm"]
GROUP_OPEN_MEMBERS = _Q["group_open_members"]
RESUME_GROUPS = _Q["resume_groups"]
DROP_RESUME = _Q["drop_resume"]
DELIVERY_ALARMS = _Q["delivery_alarms"]
GET_DELIVERY = _Q["get_delivery"]
NOW = _Q["now"]


@dataclass(frozen=True, slots=True)
class Horizon:
    """The consumer's horizon and the oldest transaction running when it was read (xid8)."""

    horizon: str
    running: str


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    event_id: uuid.UUID
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class NewDelivery:
    event_id: uuid.UUID
    outbox_id: int
    event: str
    receiver: str
    body: dict[str, Any]
    alarm_id: int | None
    device_id: str | None
    rule_key: str | None
    severity: str | None
    silence_id: int | None
    due_in_s: float
    event_created_at: datetime
    inhibited_by: int | None = None
    inhibit_rule: str | None = None
    suppressed: str | None = None  # why it is never sent (a shelf, out of service)
    # The route that chose the receiver groups: a shelf's end tells only ungrouped ones again.
    route_grouped: bool = False


@dataclass(frozen=True, slots=True)
class ClaimedDelivery:
    id: int
    event_id: uuid.UUID
    event: str
    receiver: str
    body: str
    attempts: int
    severity: str | None
    rule_key: str | None
    device_id: str | None
    alarm_id: int | None
    event_created_at: datetime
    created_at: datetime
    # The database's time of the claim: what the attempt is dated by (its webhook signature),
    # never the node's own clock, which may be minutes off.
    claimed_at: datetime
    group_id: int | None = None
    # An e-mail some recipients already took: those still owed it (None: all of ``to``), and
    # those refused for good on the way ("address: answer; ...").
    recipients_owed: list[str] | None = None
    recipients_missed: str | None = None


async def db_now(conn: asyncpg.Connection) -> datetime:
    """The transaction's time on the database clock (shared by every node)."""
    value: datetime = await conn.fetchval(NOW)
    return value


async def ensure_consumer(conn: asyncpg.Connection, consumer: str) -> None:
    await conn.execute(ENSURE_CONSUMER, consumer)


async def read_horizon(conn: asyncpg.Connection, consumer: str) -> Horizon:
    """The consumer's horizon and the oldest transaction running now (see ensure_consumer)."""
    row = await conn.fetchrow(READ_HORIZON, consumer)
    assert row is not None  # ensure_consumer ran first
    return Horizon(horizon=row["horizon"], running=row["running"])


async def skip_horizon(conn: asyncpg.Connection, consumer: str) -> None:
    await conn.execute(SKIP_HORIZON, consumer)


async def scan_unconsumed(
    conn: asyncpg.Connection, consumer: str, horizon: str, limit: int, types: Sequence[str]
) -> list[OutboxRow]:
    rows = await conn.fetch(SCAN_UNCONSUMED, consumer, horizon, limit, list(types))
    return [OutboxRow(**dict(r.items())) for r in rows]


async def consume_events(
    conn: asyncpg.Connection, consumer: str, event_ids: Sequence[uuid.UUID]
) -> set[uuid.UUID]:
    """Record the events consumed (in the caller's transaction); those not consumed before."""
    return {r["event_id"] for r in await conn.fetch(CONSUME_EVENTS, consumer, list(event_ids))}


async def advance_horizon(
    conn: asyncpg.Connection, consumer: str, running: str, types: Sequence[str]
) -> str:
    value = await conn.fetchval(ADVANCE_HORIZON, consumer, running, list(types))
    return str(value)


async def alarm_facts(
    conn: asyncpg.Connection, alarm_ids: Sequence[int]
) -> dict[int, dict[str, Any]]:
    """What the notifications say of these alarms, as they are now; the ones quiet hours hold
    locked first (share, until the caller's transaction ends: see lock_held_alarms)."""
    await conn.execute(LOCK_HELD_ALARMS, list(alarm_ids))
    rows = await conn.fetch(ALARM_FACTS, list(alarm_ids))
    return {int(r["id"]): dict(r.items()) for r in rows}


async def alarm_suppressions(
    conn: asyncpg.Connection, pairs: Sequence[tuple[int, datetime]]
) -> list[str | None]:
    """For each (alarm id, event time): why the alarm's notifications are suppressed then
    ("shelved (shelf N)", "out of service"), or None; in the order given."""
    return [why for why, _ in await alarm_suppressions_by(conn, pairs)]


async def alarm_suppressions_by(
    conn: asyncpg.Connection, pairs: Sequence[tuple[int, datetime]]
) -> list[tuple[str | None, int | None]]:
    """As :func:`alarm_suppressions`, each with the shelf's id when a shelf suppresses."""
    found: list[tuple[str | None, int | None]] = [(None, None)] * len(pairs)
    if not pairs:
        return found
    rows = await conn.fetch(_Q["alarm_suppressions"], [p[0] for p in pairs], [p[1] for p in pairs])
    for row in rows:
        if row["shelf_id"] is not None:
            found[row["n"] - 1] = (f"shelved (shelf {row['shelf_id']})", int(row["shelf_id"]))
        elif row["out_of_service"]:
            found[row["n"] - 1] = ("out of service", None)
    return found


async def lock_ended_shelves(
    conn: asyncpg.Connection, shelf_ids: Sequence[int]
) -> list[asyncpg.Record]:
    """Lock these shelves (share, in the caller's transaction, in id order) and return those
    that have ended: their end was decided before this transaction could add to what it
    owes (shelf_returns), so the caller settles it."""
    if not shelf_ids:
        return []
    # All of them locked (a WHERE on ended_at would leave those in force unlocked).
    rows = await conn.fetch(_Q["lock_ended_shelves"], sorted(set(shelf_ids)))
    return [r for r in rows if r["ended_at"] is not None]


async def hold_shelf_ends(conn: asyncpg.Connection, shelves: Sequence[asyncpg.Record]) -> None:
    """Before settling what these shelves' ends owe (shelf_returns), wait for any other
    transaction settling an end over the same (device, rule) pairs, until it ends (in the
    caller's transaction): the later one then sees the earlier's end and its returns."""
    if not shelves:
        return
    await conn.execute(
        _Q["hold_shelf_ends"], [s["device_id"] for s in shelves], [s["rule_key"] for s in shelves]
    )


async def active_silences(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(await conn.fetch(ACTIVE_SILENCES))


async def insert_deliveries(
    conn: asyncpg.Connection, deliveries: Sequence[NewDelivery]
) -> list[asyncpg.Record]:
    if not deliveries:
        return []
    d = deliveries
    return list(
        await conn.fetch(
            INSERT_DELIVERIES,
            [x.event_id for x in d],
            [x.outbox_id for x in d],
            [x.event for x in d],
            [x.receiver for x in d],
            [msgspec.json.encode(x.body).decode() for x in d],
            [x.alarm_id for x in d],
            [x.device_id for x in d],
            [x.rule_key for x in d],
            [x.severity for x in d],
            [x.silence_id for x in d],
            [x.due_in_s for x in d],
            [x.event_created_at for x in d],
            [x.inhibited_by for x in d],
            [x.inhibit_rule for x in d],
            [x.suppressed for x in d],
            [x.route_grouped for x in d],
        )
    )


async def claim_due(
    conn: asyncpg.Connection, *, receiver: str, node_id: str, lease_s: float, limit: int
) -> list[ClaimedDelivery]:
    rows = await conn.fetch(CLAIM_DUE, receiver, node_id, lease_s, limit)
    return [ClaimedDelivery(**dict(r.items())) for r in rows]


async def finish_sent(
    conn: asyncpg.Connection | asyncpg.Pool,
    delivery_id: int,
    node_id: str,
    attempt: int,
    *,
    missed: str | None = None,
) -> float | None:
    """``missed``: what the receiver refused of an accepted delivery (recipients), kept as its
    ``last_error``; None clears it. The delivery's latency in seconds (from its event's
    creation, on the database's clock), or None when the claim is no longer this attempt's."""
    latency: float | None = await conn.fetchval(FINISH_SENT, delivery_id, node_id, attempt, missed)
    return latency


async def finish_retry(
    conn: asyncpg.Connection | asyncpg.Pool,
    delivery_id: int,
    node_id: str,
    attempt: int,
    *,
    retry_in_s: float,
    error: str,
) -> bool:
    value = await conn.fetchval(FINISH_RETRY, delivery_id, node_id, attempt, retry_in_s, error)
    return value is not None


async def finish_partly(
    conn: asyncpg.Connection | asyncpg.Pool,
    delivery_id: int,
    node_id: str,
    attempt: int,
    *,
    retry_in_s: float,
    owed: Sequence[str],
    missed: str | None,
    error: str,
) -> float | None:
    """An e-mail some recipients took and ``owed`` were refused for now (a greylisting 451):
    PENDING again, the next attempt for ``owed`` alone; ``missed``: those refused for good.
    The delivery's latency to this acceptance (database clock), or None when the claim is no
    longer this attempt's."""
    latency: float | None = await conn.fetchval(
        FINISH_PARTLY, delivery_id, node_id, attempt, retry_in_s, list(owed), missed, error
    )
    return latency


async def finish_failed(
    conn: asyncpg.Connection | asyncpg.Pool,
    delivery_id: int,
    node_id: str,
    attempt: int,
    *,
    error: str,
) -> bool:
    return await conn.fetchval(FINISH_FAILED, delivery_id, node_id, attempt, error) is not None


async def wake_deferring_groups(conn: asyncpg.Connection, delivery_id: int) -> int:
    """A grouped window just FAILED: the groups of its route for the receiver that stopped
    repeating while they left its alarms to it repeat again; the number woken."""
    status = await conn.execute(WAKE_DEFERRING_GROUPS, delivery_id)
    return int(status.split()[-1])


async def pending_stats(conn: asyncpg.Connection | asyncpg.Pool) -> tuple[int, float]:
    row = await conn.fetchrow(PENDING_STATS)
    assert row is not None
    return int(row["pending"]), float(row["oldest_age_s"])


async def insert_silence(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    matchers: dict[str, Any],
    ends_at: datetime,
    comment: str,
    created_by: str,
) -> asyncpg.Record:
    row = await conn.fetchrow(
        INSERT_SILENCE, msgspec.json.encode(matchers).decode(), ends_at, comment, created_by
    )
    assert row is not None
    return row


async def list_silences(
    conn: asyncpg.Connection | asyncpg.Pool, *, active_only: bool, before: int | None, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(LIST_SILENCES, active_only, before, limit))


async def get_silence(
    conn: asyncpg.Connection | asyncpg.Pool, silence_id: int
) -> asyncpg.Record | None:
    return await conn.fetchrow(GET_SILENCE, silence_id)


async def expire_silence(conn: asyncpg.Connection, silence_id: int, by: str) -> bool:
    return await conn.fetchval(EXPIRE_SILENCE, silence_id, by) is not None


async def list_deliveries(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    status: str | None,
    receiver: str | None,
    event: str | None,
    before: int | None,
    limit: int,
) -> list[asyncpg.Record]:
    return list(await conn.fetch(LIST_DELIVERIES, status, receiver, event, before, limit))


async def get_delivery(
    conn: asyncpg.Connection | asyncpg.Pool, delivery_id: int
) -> asyncpg.Record | None:
    return await conn.fetchrow(GET_DELIVERY, delivery_id)


async def open_alarms_of_rules(
    conn: asyncpg.Connection, rule_keys: Sequence[str]
) -> list[asyncpg.Record]:
    return list(await conn.fetch(OPEN_ALARMS_OF_RULES, list(rule_keys)))


@dataclass(frozen=True, slots=True)
class GroupRow:
    """A group's row, locked by the caller's transaction, and its latest window."""

    id: int
    windows: int
    window_delivery_id: int | None
    window_due_at: datetime | None


async def lock_group(
    conn: asyncpg.Connection, receiver: str, group_key: str, labels: dict[str, str]
) -> GroupRow:
    row = await conn.fetchrow(LOCK_GROUP, receiver, group_key, msgspec.json.encode(labels).decode())
    assert row is not None
    return GroupRow(**dict(row.items()))


async def open_window(conn: asyncpg.Connection, delivery_id: int | None) -> int | None:
    """The number of notifications the group's latest window lists if it is open (locked
    till the caller commits); None if it is not."""
    if delivery_id is None:
        return None
    row = await conn.fetchrow(OPEN_WINDOW, delivery_id)
    return None if row is None else int(row["count"])


async def append_to_window(
    conn: asyncpg.Connection, delivery_id: int, item: dict[str, Any]
) -> None:
    await conn.execute(APPEND_TO_WINDOW, delivery_id, msgspec.json.encode(item).decode())


@dataclass(frozen=True, slots=True)
class NewWindow:
    event_id: uuid.UUID
    outbox_id: int
    receiver: str
    body: Any  # a protocol.notifications.GroupedNotification; encoded as JSON
    due_at: datetime
    event_created_at: datetime
    group_id: int
    device_id: str | None
    rule_key: str | None
    severity: str | None


async def insert_window(conn: asyncpg.Connection, window: NewWindow) -> int | None:
    """The window's delivery id; None if it was made already (its event id is taken)."""
    w = window
    value = await conn.fetchval(
        INSERT_WINDOW,
        w.event_id,
        w.outbox_id,
        w.receiver,
        msgspec.json.encode(w.body).decode(),
        w.due_at,
        w.event_created_at,
        w.group_id,
        w.device_id,
        w.rule_key,
        w.severity,
    )
    return None if value is None else int(value)


async def set_window(
    conn: asyncpg.Connection,
    group_id: int,
    *,
    windows: int,
    delivery_id: int,
    due_at: datetime,
    repeat_interval_s: float,
    group_interval_s: float,
    repeat: bool,
    route_identity: str | None = None,
) -> None:
    """``route_identity``: the route that made the window (None: a repeat, the group's
    stays)."""
    await conn.execute(
        SET_WINDOW,
        group_id,
        windows,
        delivery_id,
        due_at,
        repeat_interval_s,
        group_interval_s,
        repeat,
        route_identity,
    )


async def add_member(
    conn: asyncpg.Connection,
    delivery_id: int,
    event_id: uuid.UUID,
    alarm_id: int | None,
    *,
    group_id: int,
    body: dict[str, Any] | None,
) -> None:
    """The window carries the event; one with an alarm is the group's too, with its
    notification (``body``; None: a repeat's, the group has it already)."""
    text = None if body is None or alarm_id is None else msgspec.json.encode(body).decode()
    await conn.execute(ADD_MEMBER, delivery_id, event_id, alarm_id, group_id, text)


async def repeat_due(conn: asyncpg.Connection, limit: int) -> list[asyncpg.Record]:
    return list(await conn.fetch(REPEAT_DUE, limit))


async def stop_repeating(conn: asyncpg.Connection, group_id: int) -> None:
    await conn.execute(STOP_REPEATING, group_id)


async def groups_to_retime(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    """Every group: id, receiver, group_key, labels (JSON text), route_identity,
    repeat_interval_s, group_interval_s."""
    return list(await conn.fetch(GROUPS_TO_RETIME))


@dataclass(frozen=True, slots=True)
class GroupTimes:
    """The intervals a reload gives a stored group (0 repeats: it repeats no more)."""

    group_id: int
    repeat_s: float
    interval_s: float


async def route_carries_alarm(
    conn: asyncpg.Connection, group_id: int, receiver: str, identity: str, alarm_id: int
) -> bool:
    """Whether another group of the receiver made by the route of ``identity`` carries the
    alarm and reminds of it."""
    return bool(await conn.fetchval(ROUTE_CARRIES_ALARM, group_id, receiver, identity, alarm_id))


async def wake_stopped_groups(conn: asyncpg.Connection) -> int:
    """After a reload's retime: the stopped groups with an alarm still open repeat again (an
    empty pass stops them again); the number woken."""
    status = await conn.execute(WAKE_STOPPED_GROUPS)
    return int(status.split()[-1])


async def retime_groups(conn: asyncpg.Connection, times: Sequence[GroupTimes]) -> int:
    """The groups given their intervals (those that differ); the number changed."""
    status = await conn.execute(
        RETIME_GROUPS,
        [t.group_id for t in times],
        [t.repeat_s for t in times],
        [t.interval_s for t in times],
    )
    return int(status.split()[-1])


async def group_open_members(conn: asyncpg.Connection, group_id: int) -> list[asyncpg.Record]:
    """What the group's repeat lists: each open, unshelved alarm once (event_id, alarm_id,
    body as JSON text, of its newest notification), in the order first carried; forgets the
    group's alarms dealt with, and an open alarm's notifications between its first and newest."""
    return list(await conn.fetch(GROUP_OPEN_MEMBERS, group_id))


async def shelf_returns(conn: asyncpg.Connection, shelf_id: int) -> list[asyncpg.Record]:
    """What the end of this shelf owes the ungrouped routes: per (alarm, receiver), the newest
    notification the shelf suppressed, with the alarm as it is now (in the caller's
    transaction, the one that ended the shelf)."""
    return list(await conn.fetch(_Q["shelf_returns"], shelf_id))


async def resume_groups(conn: asyncpg.Connection, shelf_id: int) -> list[int]:
    """The groups owed a repeat by the end of this shelf (in the caller's transaction)."""
    return [int(r["id"]) for r in await conn.fetch(RESUME_GROUPS, shelf_id)]


async def drop_resume(conn: asyncpg.Connection, group_id: int) -> None:
    await conn.execute(DROP_RESUME, group_id)


async def delivery_alarms(conn: asyncpg.Connection, delivery_id: int) -> list[int]:
    return [int(r["alarm_id"]) for r in await conn.fetch(DELIVERY_ALARMS, delivery_id)]
