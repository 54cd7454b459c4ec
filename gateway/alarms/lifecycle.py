"""The alarm lifecycle: storage and the pure alarm domain, wired together — every transition
in the caller's transaction, with its audit row and outbox event.

Every status change is ``UPDATE … WHERE id = $1 AND status = $expected``, written with its
audit row and its outbox event in one transaction: if any of the three fails, none happens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from gateway.alarms.held import suppress_held
from gateway.domain.alarm import (
    Action,
    Alarm,
    AlarmError,
    AlarmStatus,
    IllegalTransitionError,
    RefireOutcome,
    active_key,
    apply,
    dedup_key,
    on_refire,
)
from gateway.domain.errors import ConcurrentWriteError
from protocol.events import (
    Aggregate,
    AlarmChanged,
    AlarmCleared,
    AlarmCreated,
    EventType,
)
from storage import ai_tasks as ai_repo
from storage import alarms as repo
from storage import outbox
from storage.audit import mark_lock_wait

AGGREGATE = Aggregate.ALARM
RULES_ACTOR = "system:rules"

# The step each people's action records: finding it already taken means someone else did it.
_STEP_OF: dict[Action, str] = {
    Action.CONFIRM: "confirmed",
    Action.HANDLE: "handled",
    Action.CLOSE: "closed",
    Action.FALSE: "false",
}


class AlarmNotFoundError(AlarmError):
    code = "NOT_FOUND"

    def __init__(self, alarm_id: int) -> None:
        super().__init__(f"no alarm {alarm_id}")
        self.alarm_id = alarm_id


# The person's step each status records (the system's steps record no actor).
_BY_OF: dict[AlarmStatus, str] = {
    AlarmStatus.CONFIRMED: "confirmed_by",
    AlarmStatus.HANDLED: "handled_by",
    AlarmStatus.CLOSED: "closed_by",
    AlarmStatus.FALSE: "false_by",
}


class StatusChangedError(AlarmError):
    """The prior-status update lost: someone changed the alarm first (HTTP 409). ``actor``:
    who took the step the caller asked for, else the person whose step the alarm is in now
    (None for a system's step: escalated, superseded, pushed...)."""

    code = "STATUS_CHANGED"

    def __init__(self, current: Alarm, action: Action) -> None:
        step = _STEP_OF.get(action)
        by = getattr(current, f"{step}_by", None) if step else None
        if by:
            detail = f"already {step} by {by}"
        else:
            field = _BY_OF.get(current.status)
            by = getattr(current, field) if field else None
            detail = f"the alarm is now {current.status.value}" + (f" (by {by})" if by else "")
        super().__init__(f"alarm {current.id} changed meanwhile: {detail}")
        self.current = current
        self.actor = by


def alarm_from_record(record: asyncpg.Record) -> Alarm:
    fields = {name: record[name] for name in Alarm.__struct_fields__}
    if isinstance(fields["trigger"], str):  # jsonb comes as its text
        fields["trigger"] = msgspec.json.decode(fields["trigger"])
    return msgspec.convert(fields, Alarm, strict=False)


def event_payload(
    alarm: Alarm, *, action: str, actor: str, from_status: AlarmStatus | None
) -> AlarmChanged:
    """The payload of an alarm's step (``alarm.status_changed``, ``.superseded``, ``.woken``,
    ``.escalated``): the alarm as it is now, the step, who took it, from which status."""
    return AlarmChanged(
        alarm=alarm,
        action=action,
        actor=actor,
        from_=None if from_status is None else from_status.value,
    )


def created_payload(
    alarm: Alarm, *, reason: str, supersedes: int | None, late: bool = False
) -> AlarmCreated:
    """The payload of ``alarm.created``: a step from nothing by the rules, and why."""
    step = event_payload(alarm, action="create", actor=RULES_ACTOR, from_status=None)
    return AlarmCreated(
        **msgspec.structs.asdict(step), reason=reason, supersedes=supersedes, late=late
    )


def _lifecycle_values(alarm: Alarm) -> dict[str, Any]:
    return {column: getattr(alarm, column) for column in repo.LIFECYCLE_COLUMNS}


async def _record(
    conn: asyncpg.Connection,
    *,
    alarm: Alarm,
    event_type: EventType,
    action: str,
    from_status: AlarmStatus | None,
    actor: str,
    node_id: str,
    note: str | None = None,
    request_id: str | None = None,
    event_id: str | None = None,
    created: AlarmCreated | None = None,
    stated_actor: str | None = None,
) -> None:
    """The audit row and the outbox event of one change, on the change's transaction."""
    await repo.insert_audit(
        conn,
        alarm_id=alarm.id,
        actor=actor,
        stated_actor=stated_actor,
        action=action,
        from_status=None if from_status is None else from_status.value,
        to_status=alarm.status.value,
        node_id=node_id,
        note=note,
        request_id=request_id,
        event_id=event_id,
    )
    payload = (
        created
        if created is not None
        else event_payload(alarm, action=action, actor=actor, from_status=from_status)
    )
    try:
        await outbox.add_event(
            conn,
            aggregate_type=AGGREGATE,
            aggregate_id=str(alarm.id),
            event_type=event_type,
            payload=payload,
        )
    except asyncpg.exceptions.LockNotAvailableError as exc:
        # An INSERT of its own: it waited for the table (a schema change, an index built).
        mark_lock_wait(exc, "outbox_event")
        raise


@dataclass(frozen=True, slots=True)
class SummarySpec:
    """With AI enabled: the model and prompt version a new alarm's first summary task uses."""

    model_name: str
    prompt_version: str


@dataclass(frozen=True, slots=True)
class Creation:
    created: bool
    alarm: Alarm | None = None
    superseded_id: int | None = None


async def create_alarm(
    conn: asyncpg.Connection,
    *,
    device_id: str,
    rule_key: str,
    severity: str,
    telemetry_event_id: str,
    reason: str,
    node_id: str,
    now: datetime,
    summary: SummarySpec | None = None,
    trigger: dict[str, Any] | None = None,
    rule_description: str = "",
) -> Creation:
    """Raise an alarm inside the caller's transaction (the ingest batch that fired it).

    ``trigger`` and ``rule_description`` say why it fired (kept with the alarm).

    With ``summary``, its first AI summary task is created in the same transaction: exactly
    one per real creation (a dedup hit returns before this point), with nothing to consume.

    Order matters: release the previous holder's active key, insert the new alarm, then
    point the superseded one at it; any other order trips the unique active key.
    """
    key = dedup_key(rule_key, device_id, telemetry_event_id)
    if await repo.find_by_dedup(conn, key) is not None:
        return Creation(created=False)
    held_by = active_key(device_id, rule_key)
    previous = await repo.lock_active(conn, held_by)
    superseded: tuple[int, AlarmStatus] | None = None
    if previous is not None:
        status = AlarmStatus(previous["status"])
        outcome = on_refire(status)
        if outcome is RefireOutcome.SUPERSEDE:
            if not await repo.supersede(conn, previous["id"], status.value, now):
                raise ConcurrentWriteError("the superseded alarm changed meanwhile")
            superseded = (previous["id"], status)
        elif outcome is RefireOutcome.RELEASE_KEY and not await repo.release_key(
            conn, previous["id"], status.value
        ):
            raise ConcurrentWriteError("the previous alarm changed meanwhile")
    try:
        row = await repo.insert_alarm(
            conn,
            device_id=device_id,
            rule_key=rule_key,
            severity=severity,
            telemetry_event_id=telemetry_event_id,
            dedup_key=key,
            active_key=held_by,
            triggered_at=now,
            node_id=node_id,
            trigger=trigger,
            rule_description=rule_description or None,
            reason=reason,
        )
    except asyncpg.UniqueViolationError as exc:
        # ON CONFLICT covers the dedup key only: a concurrent insert of the same alarm can
        # be caught first by the active key's unique index.
        raise ConcurrentWriteError("another node raised the same alarm first") from exc
    if row is None:
        raise ConcurrentWriteError("another node raised the same alarm first")
    alarm = alarm_from_record(row)
    if summary is not None:
        await ai_repo.insert_task(
            conn,
            alarm_id=alarm.id,
            attempt=1,
            model_name=summary.model_name,
            prompt_version=summary.prompt_version,
        )
    await _record(
        conn,
        alarm=alarm,
        event_type=EventType.ALARM_CREATED,
        action="create",
        from_status=None,
        actor=RULES_ACTOR,
        node_id=node_id,
        event_id=telemetry_event_id,
        created=created_payload(
            alarm, reason=reason, supersedes=None if superseded is None else superseded[0]
        ),
    )
    if superseded is not None:
        old_id, old_status = superseded
        await repo.link_superseded(conn, old_id, alarm.id)
        old = await repo.get(conn, old_id)
        assert old is not None
        await _record(
            conn,
            alarm=alarm_from_record(old),
            event_type=EventType.ALARM_SUPERSEDED,
            action=Action.SUPERSEDE.value,
            from_status=old_status,
            actor=RULES_ACTOR,
            node_id=node_id,
            event_id=telemetry_event_id,
        )
        if old_status is AlarmStatus.DELAYED:
            await _suppress_superseded(conn, [(old_id, alarm.id)], now)
    return Creation(
        created=True, alarm=alarm, superseded_id=None if superseded is None else superseded[0]
    )


@dataclass(frozen=True, slots=True)
class AlarmRequest:
    """A rule firing to turn into an alarm: `create_alarm`'s arguments."""

    device_id: str
    rule_key: str
    severity: str
    telemetry_event_id: str
    reason: str
    trigger: dict[str, Any] | None = None
    rule_description: str = ""


async def create_alarms(
    conn: asyncpg.Connection,
    requests: Sequence[AlarmRequest],
    *,
    node_id: str,
    now: datetime,
    summary: SummarySpec | None = None,
) -> list[Creation]:
    """`create_alarm` for each request (distinct active keys), in a few statements for all.

    One query finds the dedup hits (not created, as in `create_alarm`) and the active keys
    another alarm holds. The holders are locked in one statement (in active key order) and
    superseded or released as `create_alarm` would, each kind in one statement; then every
    new alarm is inserted with its AI task, audit row and outbox event, one statement each;
    then the superseded ones are linked to their successors with their audit rows and
    events. If another node changes one of them meanwhile (a dedup or active key taken, a
    holder changed), `ConcurrentWriteError` and the batch is retried, as with `create_alarm`.
    """
    keys = [dedup_key(r.rule_key, r.device_id, r.telemetry_event_id) for r in requests]
    holders = [active_key(r.device_id, r.rule_key) for r in requests]
    if len(set(holders)) != len(holders):
        raise ValueError("create_alarms takes requests with distinct active keys")
    dedup_hits, held = await repo.taken_keys(conn, keys, holders)
    results: dict[int, Creation] = {}
    new: list[int] = []
    holding: list[str] = []
    for index in range(len(requests)):
        if keys[index] in dedup_hits:
            results[index] = Creation(created=False)
            continue
        new.append(index)
        if holders[index] in held:
            holding.append(holders[index])
    if not new:
        return [results[index] for index in range(len(requests))]
    # The previous holders make way first: any other order trips the unique active key.
    superseded = await _make_way(conn, holding, now)
    supersedes = {i: superseded[holders[i]][0] for i in new if holders[i] in superseded}
    alarms = await _insert_fresh(
        conn,
        requests,
        keys,
        holders,
        new,
        node_id=node_id,
        now=now,
        summary=summary,
        supersedes=supersedes,
    )
    for index, alarm in zip(new, alarms, strict=True):
        results[index] = Creation(created=True, alarm=alarm, superseded_id=supersedes.get(index))
    if supersedes:
        by_index = dict(zip(new, alarms, strict=True))
        await _link_superseded(
            conn,
            [
                (old_id, by_index[i].id, superseded[holders[i]][1], requests[i].telemetry_event_id)
                for i, old_id in supersedes.items()
            ],
            node_id=node_id,
        )
        delayed = [
            (old_id, by_index[i].id)
            for i, old_id in supersedes.items()
            if superseded[holders[i]][1] is AlarmStatus.DELAYED
        ]
        if delayed:
            await _suppress_superseded(conn, delayed, now)
    return [results[index] for index in range(len(requests))]


async def _suppress_superseded(
    conn: asyncpg.Connection, links: Sequence[tuple[int, int]], now: datetime
) -> None:
    """The notifications quiet hours held for these superseded DELAYED alarms (old id, its
    successor's): SUPPRESSED, never sent; the successor's own notification tells of the
    chain (gateway.alarms.held)."""
    for old_id, new_id in links:
        await suppress_held(conn, old_id, now, f"superseded in quiet hours by alarm {new_id}")


async def _make_way(
    conn: asyncpg.Connection, holders: Sequence[str], now: datetime
) -> dict[str, tuple[int, AlarmStatus]]:
    """Lock the alarms holding these active keys and supersede or release each, as
    `create_alarm` does for one (`on_refire`); active key → (id, status before) of the
    alarms superseded. A key released since it was seen held needs nothing."""
    if not holders:
        return {}
    locked = await repo.lock_active_many(conn, holders)
    to_supersede: list[tuple[str, int, AlarmStatus]] = []
    to_release: list[tuple[int, str]] = []
    for holder in holders:
        found = locked.get(holder)
        if found is None:
            continue
        old_id, status = found[0], AlarmStatus(found[1])
        outcome = on_refire(status)
        if outcome is RefireOutcome.SUPERSEDE:
            to_supersede.append((holder, old_id, status))
        elif outcome is RefireOutcome.RELEASE_KEY:
            to_release.append((old_id, status.value))
    done = await repo.supersede_many(
        conn, [(old_id, status.value) for _, old_id, status in to_supersede], now
    )
    if len(done) != len(to_supersede):
        raise ConcurrentWriteError("the superseded alarm changed meanwhile")
    if len(await repo.release_keys(conn, to_release)) != len(to_release):
        raise ConcurrentWriteError("the previous alarm changed meanwhile")
    return {holder: (old_id, status) for holder, old_id, status in to_supersede}


async def _link_superseded(
    conn: asyncpg.Connection,
    links: Sequence[tuple[int, int, AlarmStatus, str]],
    *,
    node_id: str,
) -> None:
    """Point each superseded alarm (id, successor id, status before, the telemetry event that
    superseded it) at its successor, with its audit row and ``alarm.superseded`` event."""
    rows = await repo.link_superseded_many(conn, [(old, new) for old, new, _, _ in links])
    if len(rows) != len(links):
        raise ConcurrentWriteError("the superseded alarm changed meanwhile")
    old = {int(row["id"]): alarm_from_record(row) for row in rows}
    await repo.insert_supersede_audits(
        conn,
        alarm_ids=[link[0] for link in links],
        from_statuses=[link[2].value for link in links],
        event_ids=[link[3] for link in links],
        actor=RULES_ACTOR,
        node_id=node_id,
    )
    await outbox.add_events(
        conn,
        aggregate_type=AGGREGATE,
        event_type=EventType.ALARM_SUPERSEDED,
        events=[
            (
                str(old_id),
                event_payload(
                    old[old_id],
                    action=Action.SUPERSEDE.value,
                    actor=RULES_ACTOR,
                    from_status=status,
                ),
            )
            for old_id, _, status, _ in links
        ],
    )


async def _insert_fresh(
    conn: asyncpg.Connection,
    requests: Sequence[AlarmRequest],
    keys: Sequence[str],
    holders: Sequence[str],
    fresh: Sequence[int],
    *,
    node_id: str,
    now: datetime,
    summary: SummarySpec | None,
    supersedes: Mapping[int, int] | None = None,
) -> list[Alarm]:
    """Insert the alarms of ``fresh`` (request indexes, in order) with their AI tasks, audit
    rows and ``alarm.created`` events; ``supersedes``: request index → the alarm it replaces."""
    supersedes = supersedes or {}
    rows = [
        repo.NewAlarm(
            device_id=requests[i].device_id,
            rule_key=requests[i].rule_key,
            severity=requests[i].severity,
            telemetry_event_id=requests[i].telemetry_event_id,
            dedup_key=keys[i],
            active_key=holders[i],
            trigger=requests[i].trigger,
            rule_description=requests[i].rule_description or None,
            reason=requests[i].reason,
        )
        for i in fresh
    ]
    try:
        inserted = await repo.insert_alarms(conn, rows, triggered_at=now, node_id=node_id)
    except asyncpg.UniqueViolationError as exc:  # an active key taken since we looked
        raise ConcurrentWriteError("another node raised the same alarm first") from exc
    if len(inserted) != len(rows):  # a dedup key taken since we looked
        raise ConcurrentWriteError("another node raised the same alarm first")
    by_key = {record["dedup_key"]: alarm_from_record(record) for record in inserted}
    alarms = [by_key[keys[i]] for i in fresh]
    ids = [alarm.id for alarm in alarms]
    if summary is not None:
        await ai_repo.insert_first_tasks(
            conn, ids, model_name=summary.model_name, prompt_version=summary.prompt_version
        )
    await repo.insert_creation_audits(
        conn,
        alarm_ids=ids,
        to_statuses=[alarm.status.value for alarm in alarms],
        event_ids=[requests[i].telemetry_event_id for i in fresh],
        actor=RULES_ACTOR,
        node_id=node_id,
    )
    await outbox.add_events(
        conn,
        aggregate_type=AGGREGATE,
        event_type=EventType.ALARM_CREATED,
        events=[
            (
                str(alarm.id),
                created_payload(alarm, reason=requests[i].reason, supersedes=supersedes.get(i)),
            )
            for i, alarm in zip(fresh, alarms, strict=True)
        ],
    )
    return alarms


async def create_late_alarm(
    conn: asyncpg.Connection,
    request: AlarmRequest,
    *,
    superseded_by_event: str,
    cleared_by_event: str | None,
    node_id: str,
    now: datetime,
) -> Creation:
    """Raise the alarm of an event committed after the alarm that superseded it.

    In device order the event came first, and the alarm its successor raised (that of the
    telemetry event `superseded_by_event`) superseded it; with `cleared_by_event`, a clear
    event between the two cleared it. The alarm is created that way: SUPERSEDED, holding no
    active key, so the open list still shows the one newer alarm. No AI summary is asked
    for and nothing is pushed (the push acts on NEW alarms only).
    """
    key = dedup_key(request.rule_key, request.device_id, request.telemetry_event_id)
    row = await repo.insert_late(
        conn,
        repo.NewAlarm(
            device_id=request.device_id,
            rule_key=request.rule_key,
            severity=request.severity,
            telemetry_event_id=request.telemetry_event_id,
            dedup_key=key,
            active_key=active_key(request.device_id, request.rule_key),
            trigger=request.trigger,
            rule_description=request.rule_description or None,
            reason=request.reason,
        ),
        at=now,
        node_id=node_id,
        superseded_by_dedup_key=dedup_key(request.rule_key, request.device_id, superseded_by_event),
        clear_event_id=cleared_by_event,
    )
    if row is None:
        return Creation(created=False)
    alarm = alarm_from_record(row)
    await _record(
        conn,
        alarm=alarm,
        event_type=EventType.ALARM_CREATED,
        action="create",
        from_status=None,
        actor=RULES_ACTOR,
        node_id=node_id,
        event_id=request.telemetry_event_id,
        note="committed after a newer alarm of its rule: created superseded by it",
        created=created_payload(alarm, reason=request.reason, supersedes=None, late=True),
    )
    return Creation(created=True, alarm=alarm)


async def clear_alarm(
    conn: asyncpg.Connection,
    *,
    device_id: str,
    rule_key: str,
    clear_event_id: str,
    reason: str,
    now: datetime,
    raised_by_then: datetime | None = None,
) -> int | None:
    """Recovery: mark the active alarm cleared (never a status change). Its id, if any.

    With `raised_by_then` (a late clear), the alarm cleared is the one that was active then:
    the newest raised by a sample at or before that device time, if not cleared yet.
    """
    if raised_by_then is None:
        row = await repo.clear_active(conn, active_key(device_id, rule_key), now, clear_event_id)
    else:
        row = await repo.clear_raised_by(
            conn,
            device_id=device_id,
            rule_key=rule_key,
            device_time=raised_by_then,
            at=now,
            clear_event_id=clear_event_id,
        )
    if row is None:
        return None
    await record_cleared(conn, row, clear_event_id=clear_event_id, reason=reason)
    return int(row["id"])


async def clear_created(
    conn: asyncpg.Connection, alarm_id: int, *, clear_event_id: str, reason: str, now: datetime
) -> int:
    """Recovery of one alarm just raised (by id, not by its active key): a late occurrence
    raised on its own whose clear committed before it. How many were cleared (0 or 1)."""
    row = await repo.clear_one(conn, alarm_id, now, clear_event_id)
    if row is None:
        return 0
    await record_cleared(conn, row, clear_event_id=clear_event_id, reason=reason)
    return 1


@dataclass(frozen=True, slots=True)
class ClearRequest:
    """Recovery of the active alarm of (device, rule), by the sample ``clear_event_id``."""

    device_id: str
    rule_key: str
    clear_event_id: str
    reason: str


async def clear_alarms(
    conn: asyncpg.Connection, requests: Sequence[ClearRequest], *, now: datetime
) -> list[int]:
    """`clear_alarm` (not late) for many distinct (device, rule) at once: one statement clears
    them and one writes their ``alarm.cleared`` events, in the order of ``requests``. The ids
    of the alarms cleared (a (device, rule) with no active alarm clears nothing)."""
    if not requests:
        return []
    keys = [active_key(r.device_id, r.rule_key) for r in requests]
    if len(set(keys)) != len(keys):
        raise ValueError("clear_alarms takes each (device, rule) once")
    order = {key: index for index, key in enumerate(keys)}
    rows = await repo.clear_many(conn, keys, [r.clear_event_id for r in requests], now)
    rows.sort(key=lambda row: order[active_key(row["device_id"], row["rule_key"])])
    await record_cleared_many(
        conn,
        [
            (
                row,
                row["event_id"],
                requests[order[active_key(row["device_id"], row["rule_key"])]].reason,
            )
            for row in rows
        ],
    )
    return [int(row["id"]) for row in rows]


def _cleared_event(row: asyncpg.Record, *, clear_event_id: str, reason: str) -> AlarmCleared:
    return AlarmCleared(
        alarm_id=row["id"],
        device_id=row["device_id"],
        rule_key=row["rule_key"],
        status=row["status"],
        clear_event_id=clear_event_id,
        reason=reason,
        cleared_at=row["cleared_at"].isoformat(),
        # Why it fired, as every alarm.* event says it.
        trigger=None if row["trigger"] is None else msgspec.json.decode(row["trigger"]),
        rule_description=row["rule_description"],
    )


async def record_cleared(
    conn: asyncpg.Connection, row: asyncpg.Record, *, clear_event_id: str, reason: str
) -> None:
    """The ``alarm.cleared`` event of a cleared alarm row (id, device, rule, status,
    cleared_at, trigger, rule description), on the clearing transaction: the one shape every
    clear publishes."""
    await outbox.add_event(
        conn,
        aggregate_type=AGGREGATE,
        aggregate_id=str(row["id"]),
        event_type=EventType.ALARM_CLEARED,
        payload=_cleared_event(row, clear_event_id=clear_event_id, reason=reason),
    )


async def record_cleared_many(
    conn: asyncpg.Connection, cleared: Sequence[tuple[asyncpg.Record, str, str]]
) -> None:
    """`record_cleared` for many (row, clear event id, reason) in one statement, in order."""
    if not cleared:
        return
    await outbox.add_events(
        conn,
        aggregate_type=AGGREGATE,
        event_type=EventType.ALARM_CLEARED,
        events=[
            (str(row["id"]), _cleared_event(row, clear_event_id=event_id, reason=reason))
            for row, event_id, reason in cleared
        ],
    )


async def transition(
    conn: asyncpg.Connection,
    alarm_id: int,
    action: Action,
    *,
    actor: str,
    node_id: str,
    note: str | None = None,
    request_id: str | None = None,
    expected: AlarmStatus | None = None,
    now: datetime | None = None,
    event_type: EventType = EventType.ALARM_STATUS_CHANGED,
    stated_actor: str | None = None,
    confirmed_not_after: datetime | None = None,
    suppressed: list[str] | None = None,
) -> Alarm:
    """Apply one action in the caller's transaction, conditional on the prior status.

    ``actor`` is who acted (over the API: the token's name); ``stated_actor`` what the caller
    wrote as the actor, untrusted, kept apart in the audit row.

    ``expected``: the status the caller saw (system transitions pass it so that a timer
    never acts on an alarm a person just changed). ``now``: an injected clock (timers in
    tests); by default the database's. ``confirmed_not_after``: the write is conditional on the
    alarm's latest confirmation being at or before it too (the escalation timer: still due,
    not confirmed again since the pass read it).

    A DELAYED alarm that a person takes (confirms, handles) before its wake sends none of the
    notifications quiet hours held for it: they are recorded SUPPRESSED in this transaction
    (gateway.alarms.held), their receivers appended to ``suppressed`` if given.

    The alarm is read locked, so what is written back is what was read: a change committed
    meanwhile (a refire releasing the key of an alarm a person is on, keeping its status) is
    read, not overwritten, and one still running is waited for (docs/behaviour.md §5).
    """
    record = await repo.lock(conn, alarm_id)
    if record is None:
        raise AlarmNotFoundError(alarm_id)
    alarm = alarm_from_record(record)
    if expected is not None and alarm.status is not expected:
        raise StatusChangedError(alarm, action)
    now = max(now or await repo.db_now(conn), alarm.triggered_at)
    try:
        changed = apply(alarm, action, actor=actor, now=now)
    except IllegalTransitionError:
        step = _STEP_OF.get(action)
        if step is not None and getattr(alarm, f"{step}_at") is not None:
            raise StatusChangedError(alarm, action) from None
        raise
    row = await repo.update_lifecycle(
        conn,
        alarm.id,
        alarm.status.value,
        _lifecycle_values(changed),
        confirmed_not_after=confirmed_not_after,
    )
    if row is None:
        current = await repo.get(conn, alarm_id)
        assert current is not None
        raise StatusChangedError(alarm_from_record(current), action)
    updated = alarm_from_record(row)
    await _record(
        conn,
        alarm=updated,
        event_type=event_type,
        action=action.value,
        from_status=alarm.status,
        actor=actor,
        node_id=node_id,
        note=note,
        request_id=request_id,
        stated_actor=stated_actor,
    )
    if alarm.status is AlarmStatus.DELAYED and action is not Action.WAKE:
        why = f"{_STEP_OF.get(action, action.value)} in quiet hours by {actor}"
        receivers = await suppress_held(conn, alarm.id, now, why)
        if suppressed is not None:
            suppressed.extend(receivers)
    return updated
