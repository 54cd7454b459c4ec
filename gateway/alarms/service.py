"""Alarms for the operator API: reads and people's actions, each in its own short transaction
(the transitions themselves are in gateway/alarms/lifecycle.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

import asyncpg

from gateway.alarms import shelving
from gateway.alarms.figures import AlarmFigures
from gateway.alarms.lifecycle import (
    AlarmNotFoundError,
    StatusChangedError,
    alarm_from_record,
    transition,
)
from gateway.domain.alarm import (
    Action,
    Alarm,
    AlarmError,
    AlarmStatus,
    AlarmSupersededError,
    allowed_actions,
)
from gateway.support.metrics import Metrics
from storage import ai_tasks as ai_repo
from storage import alarms as repo
from storage import desk as desk_repo
from storage.audit import audit_failure, audit_lock_wait, lock_wait_at
from storage.desk import Filters, GroupBy, ReadAsOf, Scope, ShelvedMode
from storage.errors import DB_ERRORS, TRANSIENT_DB_ERRORS
from storage.pool import CHANGE_LOCK_WAIT_S, bound_lock_wait

# What the routes pass in (they import no storage module of their own).
__all__ = [
    "AlarmHeldError",
    "AlarmService",
    "BulkResult",
    "DeskAlarm",
    "Filters",
    "OutcomeUnknownError",
    "ReadAsOf",
    "ShelvedMode",
    "TooManyAlarmsError",
    "view_from_record",
]

# The defaults of [alarms] shelve_max_s and bulk_max (gateway.config.AlarmsConfig).
SHELVE_MAX_S: Final = 86_400.0
BULK_MAX: Final = 500
# How long a person's change waits for a row another transaction holds (an alarm, a shelf, a
# device's period): see storage.pool.CHANGE_LOCK_WAIT_S.
LOCK_WAIT_S: Final = CHANGE_LOCK_WAIT_S
# The faults that, met by a COMMIT, leave its outcome unknown: the connection or the server went
# away before its answer came back, so the server may have committed it. (A rollback the
# server answered, a deadlock or a refused row, is an answer: nothing was applied.)
COMMIT_LOST: Final[tuple[type[BaseException], ...]] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.OperatorInterventionError,
)


@dataclass(frozen=True, slots=True)
class DeskAlarm:
    """An alarm as the desk shows it: until when it is shelved now (None: it is not), and
    whether its device was out of service when it was raised."""

    alarm: Alarm
    shelved_until: datetime | None
    out_of_service: bool


def view_from_record(record: asyncpg.Record) -> DeskAlarm:
    return DeskAlarm(
        alarm=alarm_from_record(record),
        shelved_until=record["shelved_until"],
        out_of_service=bool(record["out_of_service"]),
    )


@dataclass(frozen=True, slots=True)
class BulkResult:
    """One alarm of a bulk action: the alarm after it; or ``error``, why nothing of it changed
    (an :class:`AlarmError` that refused it, or the database fault that rolled its transaction
    back: its audit row refused, the database away); or neither, when it was not attempted
    (``attempted`` false: the database went away on an earlier alarm of the action)."""

    alarm_id: int
    alarm: Alarm | None = None
    error: BaseException | None = None
    attempted: bool = True


class OutcomeUnknownError(AlarmError):
    """The database went out of reach while a person's step on an alarm was being committed:
    the server may have applied it or not, and only a read of the alarm tells (HTTP 503
    ``UNAVAILABLE`` with ``outcome_unknown``; in a bulk action, that alarm's item)."""

    code = "UNAVAILABLE"

    def __init__(self, alarm_id: int, action: Action) -> None:
        super().__init__(
            f"the database went out of reach while {action.value} of alarm {alarm_id} was "
            "being committed: it may have been applied; read the alarm before acting on it again"
        )
        self.alarm_id = alarm_id
        self.action = action


class AlarmHeldError(AlarmError):
    """Another transaction held the alarm's row for longer than ``LOCK_WAIT_S``: a person's
    step gave up waiting, nothing changed (HTTP 503 ``UNAVAILABLE`` with ``alarm_id``; in a
    bulk action, that alarm's item, and the others go on).

    Or (``table``) the alarm's audit row waited that long for its table: another transaction
    holds ``alarm_audit`` (a schema change, an index being built). Not the alarm: every alarm's
    step waits for it alike.

    Or (``at``) another statement of the step waited that long for what another transaction
    held: ``notify_delivery``, a row of the alarm's held notifications (a consumer adding to
    its window, a node stopped there); ``outbox_event``, the table its event is written to (a
    schema change, an index being built)."""

    code = "UNAVAILABLE"

    def __init__(
        self, alarm_id: int, action: Action, *, table: str | None = None, at: str | None = None
    ) -> None:
        if table is None and at == "notify_delivery":
            held = (
                f"a notification of alarm {alarm_id} kept for its quiet hours (a notify_delivery "
                "row) is held by another transaction (a notifier adding to its window, a node "
                f"stopped in the middle of it?) for more than {LOCK_WAIT_S:g} s"
            )
        elif table is None and at is not None:
            held = (
                f"alarm {alarm_id}'s event waited more than {LOCK_WAIT_S:g} s for the {at} "
                "table, held by another transaction (a schema change, an index being built?)"
            )
        elif table is None:
            held = (
                f"alarm {alarm_id} is held by another transaction (a node stopped in the middle "
                f"of a change?) for more than {LOCK_WAIT_S:g} s"
            )
        else:
            held = (
                f"alarm {alarm_id}'s audit row waited more than {LOCK_WAIT_S:g} s for the "
                f"{table} table, held by another transaction (a schema change, an index being "
                "built?)"
            )
        super().__init__(f"{held}: {action.value} gave up, nothing changed; retry")
        self.alarm_id = alarm_id
        self.action = action
        self.table = table
        self.at = at

    @property
    def held_table(self) -> str | None:
        """The table every alarm's step waits for alike (its audit table, ``outbox_event``),
        held: a bulk action stops there. None when a row was held (the alarm's, a held
        notification's): the other alarms' steps may go."""
        if self.table is not None:
            return self.table
        return self.at if self.at == "outbox_event" else None


class TooManyAlarmsError(AlarmError):
    """A bulk action over more alarms than ``[alarms] bulk_max`` (HTTP 400); nothing done."""

    code = "TOO_MANY_ALARMS"

    def __init__(self, count: int, limit: int) -> None:
        more = f"more than {limit}" if count > limit else str(count)
        super().__init__(f"{more} alarms selected; a bulk action takes at most {limit}")
        self.count = count
        self.limit = limit


def _reached_meanwhile(before: asyncpg.Record | None, now: AlarmStatus) -> bool:
    """Whether an alarm read NEW has only been pushed since (docs/behaviour.md §5)."""
    return (
        before is not None
        and before["status"] == AlarmStatus.NEW.value
        and (now is AlarmStatus.PUSHED)
    )


class AlarmService:
    """Reads and people's actions for the HTTP API, each in its own short transaction."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        node_id: str,
        metrics: Metrics | None = None,
        *,
        figures: AlarmFigures | None = None,
        shelve_max_s: float = SHELVE_MAX_S,
        bulk_max: int = BULK_MAX,
        count_suppressed: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.node_id = node_id
        self.metrics = metrics
        # Counts a held notification that a person's step on its DELAYED alarm suppressed
        # (gateway.alarms.held), by receiver: the daemon's notify metrics.
        self.count_suppressed = count_suppressed
        self.shelve_max_s = shelve_max_s
        self.bulk_max = bulk_max
        # The daemon's (reloaded with it); by default one with [alarms.figures]' defaults.
        self.figures = figures or AlarmFigures(pool)

    @contextlib.asynccontextmanager
    async def _change(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection in a transaction whose lock waits end after ``LOCK_WAIT_S`` (then
        ``LockNotAvailableError``, rolled back): a person's change."""
        async with self.pool.acquire() as conn, conn.transaction():
            await bound_lock_wait(conn, LOCK_WAIT_S)
            yield conn

    async def stats(self, window: timedelta) -> dict[str, Any]:
        """The alarm system's figures over the last ``window`` (GET /alarm-stats)."""
        return await self.figures.report(window)

    async def get(self, alarm_id: int) -> Alarm:
        async with self.pool.acquire() as conn:
            record = await repo.get(conn, alarm_id)
        if record is None:
            raise AlarmNotFoundError(alarm_id)
        return alarm_from_record(record)

    async def latest_summary(self, alarm_id: int) -> asyncpg.Record | None:
        async with self.pool.acquire() as conn:
            return await ai_repo.latest_for_alarm(conn, alarm_id)

    async def summaries(self, alarm_id: int) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn:
            if await repo.get(conn, alarm_id) is None:
                raise AlarmNotFoundError(alarm_id)
            return await ai_repo.for_alarm(conn, alarm_id)

    async def allowed(self, alarm_id: int) -> tuple[Alarm, tuple[Action, ...]]:
        alarm = await self.get(alarm_id)
        return alarm, allowed_actions(alarm.status)

    async def audit(self, alarm_id: int) -> list[dict[str, Any]]:
        async with self.pool.acquire() as conn:
            if await repo.get(conn, alarm_id) is None:
                raise AlarmNotFoundError(alarm_id)
            return [dict(r.items()) for r in await repo.audit_of(conn, alarm_id)]

    async def chain(self, alarm_id: int) -> list[DeskAlarm]:
        """Oldest first, each as the list shows it. A superseded alarm's chain is itself alone
        (see its superseded_by). One statement, whatever its length: a device nobody attends
        supersedes an alarm at each firing (a read per alarm took 16 s for 20,000)."""
        async with self.pool.acquire() as conn:
            records = await desk_repo.chain(conn, alarm_id)
        if not records:
            raise AlarmNotFoundError(alarm_id)
        return [view_from_record(r) for r in records]

    async def act(
        self,
        alarm_id: int,
        action: Action,
        *,
        actor: str,
        note: str | None = None,
        request_id: str | None = None,
        stated_actor: str | None = None,
    ) -> Alarm:
        suppressed: list[str] = []
        committing = False
        try:
            async with self._change() as conn:
                # The status this request acts on is the one it reads first: if another person
                # or a timer changes it before this request's write (the transition waits for
                # them on the row), this one lost the race, 409 (docs/behaviour.md §5), rather
                # than its action applied from a status its caller never saw.
                before = await repo.get(conn, alarm_id)
                acted_from = None if before is None else str(before["status"])

                async def step(expected: AlarmStatus | None) -> Alarm:
                    return await transition(
                        conn,
                        alarm_id,
                        action,
                        actor=actor,
                        node_id=self.node_id,
                        note=note,
                        request_id=request_id,
                        stated_actor=stated_actor,
                        expected=expected,
                        suppressed=suppressed,
                    )

                try:
                    changed = await step(None if acted_from is None else AlarmStatus(acted_from))
                except StatusChangedError as exc:
                    if exc.current.status is AlarmStatus.SUPERSEDED:
                        # Superseded meanwhile: refused as any action on a superseded alarm.
                        raise AlarmSupersededError(exc.current.superseded_by) from None
                    if not _reached_meanwhile(before, exc.current.status):
                        raise
                    # It reached someone meanwhile (NEW -> PUSHED: the open console's own
                    # stream, a subscriber): a delivery, no decision; nothing the person saw
                    # changed. The action applies from PUSHED, the row still locked by us.
                    changed = await step(AlarmStatus.PUSHED)
                    acted_from = AlarmStatus.PUSHED.value
                # What fails from here on is the COMMIT (or the connection's release).
                committing = True
        except COMMIT_LOST as exc:
            if committing and audit_failure(exc) is None:
                raise OutcomeUnknownError(alarm_id, action) from exc
            raise
        except asyncpg.exceptions.LockNotAvailableError as exc:
            # At the audit row (an INSERT of its own: no row of alarm_audit is shared, and the
            # alarm's, which its foreign key names, is ours already), the wait was its table's;
            # at the event (outbox_event) or the held notifications (notify_delivery), theirs.
            raise AlarmHeldError(
                alarm_id, action, table=audit_lock_wait(exc), at=lock_wait_at(exc)
            ) from None
        if self.metrics is not None and acted_from is not None:
            self.metrics.count_alarm_transition(acted_from, changed.status.value)
        if self.count_suppressed is not None:
            for receiver in suppressed:
                self.count_suppressed(receiver)
        return changed

    # --- the desk: views, counts, groups, bulk actions, shelves, out of service -------------

    async def view(self, alarm_id: int) -> DeskAlarm:
        async with self.pool.acquire() as conn:
            record = await desk_repo.one(conn, alarm_id)
        if record is None:
            raise AlarmNotFoundError(alarm_id)
        return view_from_record(record)

    async def views(
        self, filters: Filters, *, before_id: int | None = None, limit: int = 50
    ) -> list[DeskAlarm]:
        async with self.pool.acquire() as conn:
            records = await desk_repo.list_alarms(conn, filters, before_id=before_id, limit=limit)
        return [view_from_record(r) for r in records]

    async def groups(
        self,
        filters: Filters,
        *,
        by: GroupBy,
        limit: int,
        before: tuple[int, int] | None = None,
    ) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn:
            return await desk_repo.groups(conn, filters, by=by, limit=limit, before=before)

    async def counts(self) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn:
            return await desk_repo.counts(conn)

    async def group_ids(
        self,
        filters: Filters,
        *,
        by: GroupBy,
        key: str,
        up_to: int | None = None,
        as_of: ReadAsOf | None = None,
    ) -> list[int]:
        """The ids of one group's alarms (at most ``bulk_max``; more is refused, whole); with
        ``up_to`` (the group's newest id as its caller read it), none raised since; with
        ``as_of`` (the snapshot and time of the read), none committed after that read, a
        lower id than ``up_to`` included (ids commit out of order), nor one the read left out
        as shelved or of another status than the filter's."""
        narrowed = Filters(
            statuses=filters.statuses,
            device_id=key if by == "device" else filters.device_id,
            rule_key=key if by == "rule" else filters.rule_key,
            open_only=filters.open_only,
            active=filters.active,
            cleared=filters.cleared,
            acknowledged=filters.acknowledged,
            shelved=filters.shelved,
            severity=filters.severity,
        )
        if (by == "device" and filters.device_id not in (None, key)) or (
            by == "rule" and filters.rule_key not in (None, key)
        ):
            return []  # the group's key contradicts a filter: no alarm is in both
        async with self.pool.acquire() as conn:
            records = await desk_repo.list_alarms(
                conn,
                narrowed,
                before_id=None if up_to is None else up_to + 1,
                limit=self.bulk_max + 1,
                as_of=as_of,
            )
        if len(records) > self.bulk_max:
            raise TooManyAlarmsError(len(records), self.bulk_max)
        return [int(r["id"]) for r in records]

    async def bulk(
        self,
        action: Action,
        alarm_ids: Sequence[int],
        *,
        actor: str,
        note: str | None = None,
        request_id: str | None = None,
        stated_actor: str | None = None,
    ) -> list[BulkResult]:
        """The action on each alarm, each as ``act`` does it (its own conditional write, audit
        row and event, in its own transaction): one refused, or rolled back by a fault of its
        own (its audit row refused, its row held), leaves the others be. Once the database is
        away (a transient fault, as ``storage.errors`` defines it), or the audit table or the
        outbox's is held (:class:`AlarmHeldError` with its ``held_table``), the alarms after it
        are not attempted.
        Every alarm gets its result, and those before a fault stay committed."""
        ids = list(dict.fromkeys(alarm_ids))  # each once, in the order given
        if len(ids) > self.bulk_max:
            raise TooManyAlarmsError(len(ids), self.bulk_max)
        results: list[BulkResult] = []
        for index, alarm_id in enumerate(ids):
            away = False
            try:
                alarm = await self.act(
                    alarm_id,
                    action,
                    actor=actor,
                    note=note,
                    request_id=request_id,
                    stated_actor=stated_actor,
                )
            except OutcomeUnknownError as exc:  # lost at its COMMIT: it may have been applied
                results.append(BulkResult(alarm_id=alarm_id, error=exc))
                away = True
            except AlarmHeldError as exc:
                results.append(BulkResult(alarm_id=alarm_id, error=exc))
                # Its audit table, or the outbox's, held (an index being built): every later
                # alarm's step waits for the same table, each its LOCK_WAIT_S; they are not
                # attempted. Only a row held (the alarm's own, a held notification's) leaves
                # the others be.
                away = exc.held_table is not None
            except AlarmError as exc:
                results.append(BulkResult(alarm_id=alarm_id, error=exc))
            except DB_ERRORS as exc:  # its transaction rolled back
                results.append(BulkResult(alarm_id=alarm_id, error=exc))
                away = isinstance(exc, TRANSIENT_DB_ERRORS) and audit_failure(exc) is None
            else:
                results.append(BulkResult(alarm_id=alarm_id, alarm=alarm))
            if away:
                rest = ids[index + 1 :]
                results.extend(BulkResult(alarm_id=i, attempted=False) for i in rest)
                break
        return results

    async def shelve(
        self,
        *,
        scope: Scope,
        alarm_id: int | None,
        device_id: str | None,
        rule_key: str | None,
        seconds: float,
        reason: str,
        actor: str,
        request_id: str | None = None,
    ) -> asyncpg.Record:
        if seconds > self.shelve_max_s:
            raise shelving.ShelfTooLongError(seconds, self.shelve_max_s)
        async with self._change() as conn:
            return await shelving.shelve(
                conn,
                scope=scope,
                alarm_id=alarm_id,
                device_id=device_id,
                rule_key=rule_key,
                seconds=seconds,
                reason=reason,
                actor=actor,
                node_id=self.node_id,
                request_id=request_id,
            )

    async def lift(
        self, shelf_id: int, *, actor: str, request_id: str | None = None
    ) -> asyncpg.Record:
        async with self._change() as conn:
            shelf, lifted = await shelving.lift(
                conn, shelf_id, actor=actor, node_id=self.node_id, request_id=request_id
            )
        if not lifted:  # ended already (at its until, ended now if no timer had): committed
            raise shelving.ShelfEndedError(shelf_id)
        return shelf

    async def shelf(self, shelf_id: int) -> asyncpg.Record:
        async with self.pool.acquire() as conn:
            record = await desk_repo.get_shelf(conn, shelf_id)
        if record is None:
            raise shelving.ShelfNotFoundError(shelf_id)
        return record

    async def shelves(
        self, *, in_force: bool, before_id: int | None, limit: int
    ) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn:
            return await desk_repo.list_shelves(
                conn, in_force=in_force, before_id=before_id, limit=limit
            )

    async def set_out_of_service(
        self,
        device_id: str,
        *,
        reason: str,
        until: datetime | None,
        actor: str,
        request_id: str | None = None,
    ) -> asyncpg.Record:
        async with self._change() as conn:
            return await shelving.set_out_of_service(
                conn, device_id, reason=reason, until=until, actor=actor, request_id=request_id
            )

    async def end_out_of_service(self, device_id: str, *, actor: str) -> asyncpg.Record:
        async with self._change() as conn:
            return await shelving.end_out_of_service(conn, device_id, actor=actor)

    async def out_of_service(self, device_id: str) -> asyncpg.Record | None:
        """The device's maintenance period in force now, if any."""
        async with self.pool.acquire() as conn:
            return await desk_repo.period_in_force(conn, device_id)
