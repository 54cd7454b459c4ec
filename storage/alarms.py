"""Alarm rows: conditional writes on the caller's connection (and transaction).

Rows come back as ``asyncpg.Record``; the gateway maps them to its domain ``Alarm``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from storage.ingest import receipt_age
from storage.sql import load_queries

_Q = load_queries("alarms.sql")
FIND_BY_DEDUP = _Q["find_by_dedup"]
LOCK_ACTIVE = _Q["lock_active"]
SUPERSEDE = _Q["supersede"]
RELEASE_KEY = _Q["release_key"]
INSERT_ALARM = _Q["insert_alarm"]
LINK_SUPERSEDED = _Q["link_superseded"]
TAKEN_KEYS = _Q["taken_keys"]
INSERT_ALARMS = _Q["insert_alarms"]
INSERT_CREATION_AUDITS = _Q["insert_creation_audits"]
CLEAR_ACTIVE = _Q["clear_active"]
CLEAR_ONE = _Q["clear_one"]
INSERT_LATE = _Q["insert_late"]
SUCCESSOR_OPEN = _Q["successor_open"]
CLEAR_RAISED_BY = _Q["clear_raised_by"]
GET = _Q["get"]
LOCK = _Q["lock"]
STILL_NEW = _Q["still_new"]
UPDATE_LIFECYCLE = _Q["update_lifecycle"]
INSERT_AUDIT = _Q["insert_audit"]
AUDIT_OF = _Q["audit_of"]
NOW = _Q["now"]
CLOCK_NOW = _Q["clock_now"]
CLEAR_MANY = _Q["clear_many"]
LOCK_ACTIVE_MANY = _Q["lock_active_many"]
SUPERSEDE_MANY = _Q["supersede_many"]
RELEASE_KEYS = _Q["release_keys"]
LINK_SUPERSEDED_MANY = _Q["link_superseded_many"]
INSERT_SUPERSEDE_AUDITS = _Q["insert_supersede_audits"]
SILENT_DEVICES = _Q["silent_devices"]
# Silent devices read per statement: a fleet that churns ids leaves rows that never speak
# again, and those a rule's selector leaves out are read at every pass (~0.3 KB each).
SILENT_PAGE = 1000
LOCK_UNHEARD = _Q["lock_unheard"]
UNCLEARED_INACTIVITY_RULES = _Q["uncleared_inactivity_rules"]
DELAYED = _Q["delayed"]
ESCALATION_DUE = _Q["escalation_due"]
MARK_UNREACHED = _Q["mark_unreached"]
REMINDER_DUE = _Q["reminder_due"]
MARK_REMINDED = _Q["mark_reminded"]

# Columns update_lifecycle writes, in parameter order after (id, expected status).
LIFECYCLE_COLUMNS = (
    "status",
    "active_key",
    "pushed_at",
    "delayed_at",
    "woken_at",
    "confirmed_at",
    "confirmed_by",
    "handled_at",
    "handled_by",
    "closed_at",
    "closed_by",
    "false_at",
    "false_by",
    "escalated_at",
    "superseded_at",
    "superseded_by",
    "last_notified_at",
)


async def find_by_dedup(conn: asyncpg.Connection, dedup_key: str) -> int | None:
    value = await conn.fetchval(FIND_BY_DEDUP, dedup_key)
    return None if value is None else int(value)


async def lock_active(conn: asyncpg.Connection, active_key: str) -> asyncpg.Record | None:
    return await conn.fetchrow(LOCK_ACTIVE, active_key)


async def supersede(conn: asyncpg.Connection, alarm_id: int, expected: str, at: datetime) -> bool:
    return await conn.fetchval(SUPERSEDE, alarm_id, expected, at) is not None


async def release_key(conn: asyncpg.Connection, alarm_id: int, expected: str) -> bool:
    return await conn.fetchval(RELEASE_KEY, alarm_id, expected) is not None


async def insert_alarm(
    conn: asyncpg.Connection,
    *,
    device_id: str,
    rule_key: str,
    severity: str,
    telemetry_event_id: str,
    dedup_key: str,
    active_key: str,
    triggered_at: datetime,
    node_id: str,
    trigger: dict[str, Any] | None = None,
    rule_description: str | None = None,
    reason: str | None = None,
) -> asyncpg.Record | None:
    """The new row, or None on a dedup hit."""
    return await conn.fetchrow(
        INSERT_ALARM,
        device_id,
        rule_key,
        severity,
        telemetry_event_id,
        dedup_key,
        active_key,
        triggered_at,
        node_id,
        _json(trigger),
        rule_description,
        reason,
    )


def _json(value: dict[str, Any] | None) -> str | None:
    return None if value is None else msgspec.json.encode(value).decode()


@dataclass(frozen=True, slots=True)
class NewAlarm:
    """One row of `insert_alarms`."""

    device_id: str
    rule_key: str
    severity: str
    telemetry_event_id: str
    dedup_key: str
    active_key: str
    trigger: dict[str, Any] | None = None
    rule_description: str | None = None
    # Why the rule fired (its alarm.created event's reason), kept with the alarm: the event
    # is pruned with the outbox, and an AI summary asked for later still needs it.
    reason: str | None = None


async def taken_keys(
    conn: asyncpg.Connection, dedup_keys: Sequence[str], active_keys: Sequence[str]
) -> tuple[set[str], set[str]]:
    """Of these keys: the dedup keys some alarm already has, the active keys one holds now."""
    row = await conn.fetchrow(TAKEN_KEYS, list(dedup_keys), list(active_keys))
    assert row is not None
    return set(row["dedup_hits"]), set(row["held"])


async def insert_alarms(
    conn: asyncpg.Connection, alarms: Sequence[NewAlarm], *, triggered_at: datetime, node_id: str
) -> list[asyncpg.Record]:
    """Insert NEW alarms in one statement; the rows inserted (a dedup hit inserts none)."""
    records = await conn.fetch(
        INSERT_ALARMS,
        [a.device_id for a in alarms],
        [a.rule_key for a in alarms],
        [a.severity for a in alarms],
        [a.telemetry_event_id for a in alarms],
        [a.dedup_key for a in alarms],
        [a.active_key for a in alarms],
        triggered_at,
        node_id,
        [_json(a.trigger) for a in alarms],
        [a.rule_description for a in alarms],
        [a.reason for a in alarms],
    )
    return list(records)


async def insert_creation_audits(
    conn: asyncpg.Connection,
    *,
    alarm_ids: Sequence[int],
    to_statuses: Sequence[str],
    event_ids: Sequence[str],
    actor: str,
    node_id: str,
) -> None:
    await conn.execute(
        INSERT_CREATION_AUDITS,
        list(alarm_ids),
        list(to_statuses),
        list(event_ids),
        actor,
        node_id,
    )


async def link_superseded(conn: asyncpg.Connection, old_id: int, new_id: int) -> None:
    await conn.execute(LINK_SUPERSEDED, old_id, new_id)


async def lock_active_many(
    conn: asyncpg.Connection, active_keys: Sequence[str]
) -> dict[str, tuple[int, str]]:
    """`lock_active` for many keys: active key → (id, status) of the alarm holding it."""
    if not active_keys:
        return {}
    rows = await conn.fetch(LOCK_ACTIVE_MANY, list(active_keys))
    return {row["active_key"]: (int(row["id"]), row["status"]) for row in rows}


async def supersede_many(
    conn: asyncpg.Connection, alarms: Sequence[tuple[int, str]], at: datetime
) -> set[int]:
    """`supersede` for many (id, expected status): the ids superseded."""
    if not alarms:
        return set()
    rows = await conn.fetch(SUPERSEDE_MANY, [a[0] for a in alarms], [a[1] for a in alarms], at)
    return {int(row["id"]) for row in rows}


async def release_keys(conn: asyncpg.Connection, alarms: Sequence[tuple[int, str]]) -> set[int]:
    """`release_key` for many (id, expected status): the ids released."""
    if not alarms:
        return set()
    rows = await conn.fetch(RELEASE_KEYS, [a[0] for a in alarms], [a[1] for a in alarms])
    return {int(row["id"]) for row in rows}


async def link_superseded_many(
    conn: asyncpg.Connection, links: Sequence[tuple[int, int]]
) -> list[asyncpg.Record]:
    """`link_superseded` for many (superseded id, new id): the superseded rows."""
    if not links:
        return []
    return list(
        await conn.fetch(LINK_SUPERSEDED_MANY, [old for old, _ in links], [new for _, new in links])
    )


async def insert_supersede_audits(
    conn: asyncpg.Connection,
    *,
    alarm_ids: Sequence[int],
    from_statuses: Sequence[str],
    event_ids: Sequence[str],
    actor: str,
    node_id: str,
) -> None:
    if alarm_ids:
        await conn.execute(
            INSERT_SUPERSEDE_AUDITS,
            list(alarm_ids),
            list(from_statuses),
            list(event_ids),
            actor,
            node_id,
        )


async def clear_active(
    conn: asyncpg.Connection, active_key: str, at: datetime, clear_event_id: str
) -> asyncpg.Record | None:
    return await conn.fetchrow(CLEAR_ACTIVE, active_key, at, clear_event_id)


async def clear_one(
    conn: asyncpg.Connection, alarm_id: int, at: datetime, clear_event_id: str
) -> asyncpg.Record | None:
    return await conn.fetchrow(CLEAR_ONE, alarm_id, at, clear_event_id)


async def successor_open(conn: asyncpg.Connection, dedup_key: str) -> bool:
    """Whether the alarm of ``dedup_key`` exists and has not ended."""
    return bool(await conn.fetchval(SUCCESSOR_OPEN, dedup_key))


async def insert_late(
    conn: asyncpg.Connection,
    alarm: NewAlarm,
    *,
    at: datetime,
    node_id: str,
    superseded_by_dedup_key: str,
    clear_event_id: str | None,
) -> asyncpg.Record | None:
    """Insert an alarm already SUPERSEDED (see `insert_late`); None on a dedup hit."""
    return await conn.fetchrow(
        INSERT_LATE,
        alarm.device_id,
        alarm.rule_key,
        alarm.severity,
        alarm.telemetry_event_id,
        alarm.dedup_key,
        at,
        node_id,
        superseded_by_dedup_key,
        clear_event_id,
        _json(alarm.trigger),
        alarm.rule_description,
        alarm.reason,
    )


async def get(conn: asyncpg.Connection, alarm_id: int) -> asyncpg.Record | None:
    return await conn.fetchrow(GET, alarm_id)


async def lock(conn: asyncpg.Connection, alarm_id: int) -> asyncpg.Record | None:
    """The alarm, locked until the caller's transaction ends (waiting for one writing it)."""
    return await conn.fetchrow(LOCK, alarm_id)


async def still_new(conn: asyncpg.Connection, alarm_ids: Sequence[int]) -> list[asyncpg.Record]:
    """Of ``alarm_ids``, the alarms still NEW (id, device_id, severity), in one statement."""
    return list(await conn.fetch(STILL_NEW, list(alarm_ids)))


async def update_lifecycle(
    conn: asyncpg.Connection,
    alarm_id: int,
    expected: str,
    values: dict[str, Any],
    *,
    confirmed_not_after: datetime | None = None,
) -> asyncpg.Record | None:
    """Write the new lifecycle columns if the status is still ``expected`` (and, given
    ``confirmed_not_after``, the alarm was confirmed at or before it); None if not."""
    return await conn.fetchrow(
        UPDATE_LIFECYCLE,
        alarm_id,
        expected,
        *(values[c] for c in LIFECYCLE_COLUMNS),
        confirmed_not_after,
    )


async def insert_audit(
    conn: asyncpg.Connection,
    *,
    alarm_id: int,
    actor: str,
    action: str,
    from_status: str | None,
    to_status: str,
    node_id: str,
    note: str | None = None,
    request_id: str | None = None,
    event_id: str | None = None,
    stated_actor: str | None = None,
) -> None:
    await conn.execute(
        INSERT_AUDIT,
        alarm_id,
        actor,
        action,
        from_status,
        to_status,
        note,
        request_id,
        event_id,
        node_id,
        stated_actor,
    )


async def audit_of(conn: asyncpg.Connection, alarm_id: int) -> list[asyncpg.Record]:
    return list(await conn.fetch(AUDIT_OF, alarm_id))


async def db_now(conn: asyncpg.Connection) -> datetime:
    """Transaction time on the database clock (shared by every node)."""
    value: datetime = await conn.fetchval(NOW)
    return value


async def clock_now(conn: asyncpg.Connection) -> datetime:
    """The database clock as the statement runs (not the transaction's start)."""
    value: datetime = await conn.fetchval(CLOCK_NOW)
    return value


async def clear_many(
    conn: asyncpg.Connection,
    keys: Sequence[str],
    event_ids: Sequence[str],
    at: datetime,
    *,
    by_trigger: Collection[str] = (),
    heard_at: datetime | None = None,
    received: Sequence[float | None] | None = None,
    inactivity: bool = False,
) -> list[asyncpg.Record]:
    """Clear the alarms holding `keys`; those of the rules `by_trigger` only if they are
    inactivity alarms (recognised by their trigger, not by a rule configured now); with
    `heard_at` (a replayed dead letter's receipt), only an alarm for a silence begun before
    it. `received`, per key: when the node read the device's newest message of the batch off
    the broker, on the monotonic clock (``Inbound.received_at``; None: unknown); an inactivity
    alarm for a silence that began after that is not cleared (a node a batch behind).
    `inactivity`: only inactivity alarms, whatever rule holds the key (a device heard from;
    not the alarm a threshold or event rule raised under a key a reload made an inactivity
    rule's)."""
    if not keys:
        return []
    now = time.monotonic()
    ages = [receipt_age(now, r) for r in received] if received is not None else None
    return list(
        await conn.fetch(
            CLEAR_MANY,
            list(keys),
            list(event_ids),
            at,
            list(by_trigger),
            heard_at,
            ages if ages is not None else [None] * len(keys),
            inactivity,
        )
    )


async def uncleared_inactivity_rules(
    conn: asyncpg.Connection, configured: Sequence[str]
) -> frozenset[str]:
    """The keys of rules other than `configured` that hold an uncleared inactivity alarm."""
    rows = await conn.fetch(UNCLEARED_INACTIVITY_RULES, list(configured))
    return frozenset(row["rule_key"] for row in rows)


async def clear_raised_by(
    conn: asyncpg.Connection,
    *,
    device_id: str,
    rule_key: str,
    device_time: datetime,
    at: datetime,
    clear_event_id: str,
) -> asyncpg.Record | None:
    return await conn.fetchrow(
        CLEAR_RAISED_BY, device_id, rule_key, device_time, at, clear_event_id
    )


async def silent_devices(
    conn: asyncpg.Connection,
    silent_seconds: float,
    rule_key: str,
    *,
    breaks_began: Sequence[float] = (),
    breaks_ended: Sequence[float] = (),
    configured: Sequence[str] = (),
    will_windows: Sequence[tuple[float, float]] = (),
    after: str = "",
    limit: int = SILENT_PAGE,
) -> list[asyncpg.Record]:
    """Devices silent for `silent_seconds` of this node's listening (the breaks, each when
    it began and ended in seconds before now, left out; began inf: before the process), or
    offline (`stated`: not read within one of the `will_windows`, each (earliest, latest)
    in seconds before now; `silent`: the former); not already alarmed by `rule_key`, nor for
    the same silence by a rule no longer among the `configured` inactivity rules (by
    default: `rule_key` alone). A page: `limit` at most, those after the device id `after`,
    by id."""
    return list(
        await conn.fetch(
            SILENT_DEVICES,
            silent_seconds,
            rule_key,
            list(breaks_began),
            list(breaks_ended),
            list(configured) or [rule_key],
            [earliest for earliest, _ in will_windows],
            [latest for _, latest in will_windows],
            after,
            limit,
        )
    )


async def lock_unheard(conn: asyncpg.Connection, device_id: str, last_seen: datetime) -> bool:
    """Whether the device has not been heard from since `last_seen`; its row is then locked
    (FOR SHARE) until the caller's transaction ends, so a batch storing its message waits."""
    return await conn.fetchval(LOCK_UNHEARD, device_id, last_seen) is not None


async def suppress_held_deliveries(
    conn: asyncpg.Connection, alarm_id: int, now: datetime, why: str
) -> list[str]:
    """A woken alarm's held notifications, SUPPRESSED for ``why``; their receivers."""
    rows = await conn.fetch(_Q["suppress_held_deliveries"], alarm_id, now, why)
    return [r["receiver"] for r in rows]


async def held_window_members(conn: asyncpg.Connection, alarm_id: int) -> list[asyncpg.Record]:
    """The alarm's notifications in unclaimed group windows, those windows locked."""
    return list(await conn.fetch(_Q["held_window_members"], alarm_id))


async def drop_from_window(
    conn: asyncpg.Connection,
    delivery_id: int,
    event_ids: Sequence[uuid.UUID],
    now: datetime,
    why: str,
) -> str:
    """Take these notifications out of the window; its status after (SUPPRESSED if none is
    left)."""
    status: str = await conn.fetchval(
        _Q["drop_from_window"], delivery_id, list(event_ids), now, why
    )
    return status


async def release_held_deliveries(conn: asyncpg.Connection, alarm_id: int, now: datetime) -> int:
    """A woken alarm's notifications, held while it was DELAYED: due now; how many."""
    return int(await conn.fetchval(_Q["release_held_deliveries"], alarm_id, now))


async def lock_new_alarm(conn: asyncpg.Connection, alarm_id: int) -> asyncpg.Record | None:
    """The alarm (id, device_id, severity) if still NEW, locked till the caller commits."""
    record: asyncpg.Record | None = await conn.fetchrow(_Q["lock_new_alarm"], alarm_id)
    return record


async def has_deliveries(conn: asyncpg.Connection, alarm_id: int) -> bool:
    return bool(await conn.fetchval(_Q["has_deliveries"], alarm_id))


async def delayed(conn: asyncpg.Connection, after_id: int, limit: int) -> list[asyncpg.Record]:
    return list(await conn.fetch(DELAYED, after_id, limit))


async def escalation_due(conn: asyncpg.Connection, before: datetime, limit: int) -> list[int]:
    return [int(r["id"]) for r in await conn.fetch(ESCALATION_DUE, before, limit)]


async def reminder_due(
    conn: asyncpg.Connection, before: datetime, after_id: int, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(REMINDER_DUE, before, after_id, limit))


async def mark_reminded(
    conn: asyncpg.Connection,
    alarm_id: int,
    expected: str,
    previous: datetime | None,
    now: datetime,
) -> asyncpg.Record | None:
    return await conn.fetchrow(MARK_REMINDED, alarm_id, expected, previous, now)


async def mark_unreached(
    conn: asyncpg.Connection, new_before: datetime, now: datetime, limit: int
) -> list[asyncpg.Record]:
    """Alarms NEW since at or before ``new_before`` (fired, or woken after quiet hours) not
    yet found unreached: marked now, once."""
    return list(await conn.fetch(MARK_UNREACHED, new_before, now, limit))
