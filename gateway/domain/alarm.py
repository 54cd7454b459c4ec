"""The alarm aggregate: nine states, the transition whitelist, and the invariants of a record.

Pure: no I/O and no clock reads (``now`` is always a parameter). Storage enforces the same
invariants with CHECK constraints of the same names (``storage/migrations/0002_alarm.sql``).

Invariants of an :class:`Alarm`. Each is named after the table constraint that enforces it;
:func:`check_invariants` tests them in name order, the order PostgreSQL applies CHECK
constraints in, so the domain and the table report the same first violation.

- ``alarm_active_key_matches``: the active key is NULL or ``device_id:rule_key``.
- ``alarm_active_key_released_when_terminal``: CLOSED, FALSE and SUPERSEDED hold no active key.
- ``alarm_cleared_has_event``: ``cleared_at`` and ``clear_event_id`` come together (recovery
  is an attribute, never a status); the event id is not blank.
- ``alarm_closed_actor_pair``, ``alarm_confirmed_actor_pair``, ``alarm_false_actor_pair``,
  ``alarm_handled_actor_pair``: a person's step has its timestamp and its actor together, or
  neither; the actor is not blank.
- ``alarm_closed_has_actors``: CLOSED has ``handled_at/by`` and ``closed_at/by``.
- ``alarm_confirmed_has_actor``: CONFIRMED has ``confirmed_at/by``.
- ``alarm_dedup_key_matches``: ``dedup_key`` is ``rule_key:device_id:telemetry_event_id``.
- ``alarm_delay_ended_before_push``: a pushed alarm was not inside a delay: ``delayed_at`` is
  NULL or ``woken_at >= delayed_at`` (only NEW is pushed, see the next one).
- ``alarm_delay_ended_when_new``: NEW has ``delayed_at`` only together with ``woken_at >=
  delayed_at`` (DELAYED went back to NEW by ``wake``).
- ``alarm_delayed_has_timestamp``: DELAYED has ``delayed_at``.
- ``alarm_escalated_after_confirmed``: ``escalated_at`` only together with ``confirmed_at``.
- ``alarm_escalated_has_actor_and_timestamp``: ESCALATED has ``confirmed_at/by`` and
  ``escalated_at``.
- ``alarm_false_has_actor``: FALSE has ``false_at/by``.
- ``alarm_false_not_while_delayed``: FALSE inside a delay that has not ended needs a
  confirmation first (the whitelist has no DELAYED → FALSE).
- ``alarm_handled_has_actor``: HANDLED has ``handled_at/by``.
- ``alarm_<state>_has_no_foreign_steps`` (one per state): a state holds no step that cannot lead
  to it. NEW and DELAYED: none of pushed, confirmed, escalated, handled, closed, false,
  superseded; PUSHED: none of confirmed ... superseded; CONFIRMED and ESCALATED: none of handled,
  closed, false, superseded; HANDLED: none of closed, false, superseded; CLOSED: neither false nor
  superseded; FALSE: none of handled, closed, superseded; SUPERSEDED: none of confirmed,
  escalated, handled, closed, false.
- ``alarm_not_superseded_by_itself``: ``superseded_by <> id``.
- ``alarm_pushed_has_timestamp``: PUSHED has ``pushed_at``.
- ``alarm_superseded_has_timestamp``: SUPERSEDED has ``superseded_at``. ``superseded_by`` may
  still be NULL: the successor is inserted after the predecessor released its active key, and
  ``superseded_by`` is filled a moment later in the same transaction.
- ``alarm_timestamps_not_before_trigger``: every lifecycle timestamp (pushed, delayed, woken,
  confirmed, escalated, handled, closed, false, superseded, cleared, last notified) is not
  before ``triggered_at``.
- ``alarm_timestamps_timezone_aware``: every timestamp carries a time zone (domain only: a
  ``timestamptz`` column cannot hold anything else).
- ``alarm_woken_after_delayed``: ``woken_at`` only together with ``delayed_at``.

A repeated delay (NEW → DELAYED → NEW → DELAYED) overwrites ``delayed_at`` and keeps the previous
``woken_at``; the audit trail keeps the history, the record keeps the latest of each step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final

import msgspec

from gateway.domain.errors import GatewayError
from protocol.events import AlarmSnapshot

SYSTEM_ACTOR_PREFIX: Final = "system:"


class AlarmStatus(StrEnum):
    NEW = "NEW"
    PUSHED = "PUSHED"
    DELAYED = "DELAYED"
    CONFIRMED = "CONFIRMED"
    ESCALATED = "ESCALATED"
    HANDLED = "HANDLED"
    CLOSED = "CLOSED"
    FALSE = "FALSE"
    SUPERSEDED = "SUPERSEDED"


OPEN_STATUSES: Final = frozenset(
    {
        AlarmStatus.NEW,
        AlarmStatus.PUSHED,
        AlarmStatus.DELAYED,
        AlarmStatus.CONFIRMED,
        AlarmStatus.ESCALATED,
    }
)
TERMINAL_STATUSES: Final = frozenset(
    {AlarmStatus.CLOSED, AlarmStatus.FALSE, AlarmStatus.SUPERSEDED}
)


class Severity(StrEnum):
    INFO = "INFO"
    WARNING = "WARNING"
    MAJOR = "MAJOR"
    CRITICAL = "CRITICAL"


class Action(StrEnum):
    # People's actions.
    CONFIRM = "confirm"
    HANDLE = "handle"
    CLOSE = "close"
    FALSE = "false"
    # The system's: notifier, quiet hours, scheduler, escalation timer, a refiring rule.
    PUSH = "push"
    DELAY = "delay"
    WAKE = "wake"
    ESCALATE = "escalate"
    SUPERSEDE = "supersede"


PERSON_ACTIONS: Final = frozenset({Action.CONFIRM, Action.HANDLE, Action.CLOSE, Action.FALSE})

_S, _A = AlarmStatus, Action
TRANSITIONS: Final[Mapping[tuple[AlarmStatus, Action], AlarmStatus]] = MappingProxyType(
    {
        (_S.NEW, _A.PUSH): _S.PUSHED,
        (_S.NEW, _A.DELAY): _S.DELAYED,
        (_S.NEW, _A.CONFIRM): _S.CONFIRMED,
        (_S.NEW, _A.HANDLE): _S.HANDLED,
        (_S.NEW, _A.FALSE): _S.FALSE,
        (_S.NEW, _A.SUPERSEDE): _S.SUPERSEDED,
        (_S.PUSHED, _A.CONFIRM): _S.CONFIRMED,
        (_S.PUSHED, _A.HANDLE): _S.HANDLED,
        (_S.PUSHED, _A.FALSE): _S.FALSE,
        (_S.PUSHED, _A.SUPERSEDE): _S.SUPERSEDED,
        # docs/behaviour.md §5 lists no FALSE from DELAYED: confirm first, then judge it false.
        (_S.DELAYED, _A.WAKE): _S.NEW,
        (_S.DELAYED, _A.CONFIRM): _S.CONFIRMED,
        (_S.DELAYED, _A.HANDLE): _S.HANDLED,
        (_S.DELAYED, _A.SUPERSEDE): _S.SUPERSEDED,
        (_S.CONFIRMED, _A.HANDLE): _S.HANDLED,
        (_S.CONFIRMED, _A.ESCALATE): _S.ESCALATED,
        (_S.CONFIRMED, _A.FALSE): _S.FALSE,
        (_S.ESCALATED, _A.CONFIRM): _S.CONFIRMED,
        (_S.ESCALATED, _A.HANDLE): _S.HANDLED,
        (_S.ESCALATED, _A.FALSE): _S.FALSE,
        (_S.HANDLED, _A.CLOSE): _S.CLOSED,
    }
)


class AlarmError(GatewayError):
    """Root of the alarm aggregate's errors."""


class IllegalTransitionError(AlarmError):
    """The whitelist has no ``action`` from ``status``; ``allowed`` lists what it has.

    ``allowed`` is written for whoever asked: people's actions only when a person's action was
    refused (what an operator could do instead), every action when a system action was.
    """

    code: Final = "ILLEGAL_TRANSITION"

    def __init__(self, status: AlarmStatus, action: Action, allowed: tuple[Action, ...]) -> None:
        listed = ", ".join(allowed) or "nothing"
        super().__init__(f"cannot {action} an alarm in {status}; allowed: {listed}")
        self.status = status
        self.action = action
        self.allowed = allowed


class AlarmSupersededError(AlarmError):
    """Any action on a SUPERSEDED alarm: it is handled through the alarm that replaced it."""

    code: Final = "ALARM_SUPERSEDED"

    def __init__(self, superseded_by: int | None = None) -> None:
        successor = "a newer alarm" if superseded_by is None else f"alarm {superseded_by}"
        super().__init__(f"superseded by {successor}, cannot be handled on its own")
        self.superseded_by = superseded_by


class InvalidActorError(AlarmError):
    """A person's step without a person, or a system step without a ``system:`` actor."""

    code: Final = "INVALID_ACTOR"

    def __init__(self, action: Action, actor: str, reason: str) -> None:
        super().__init__(f"{action} by {actor!r}: {reason}")
        self.action = action
        self.actor = actor
        self.reason = reason


class InvariantError(AlarmError):
    """An alarm record breaks ``invariant`` (the name of the matching table constraint)."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
        self.message = message


def allowed_actions(status: AlarmStatus, *, people_only: bool = True) -> tuple[Action, ...]:
    """Actions the whitelist allows from ``status``, in :class:`Action` declaration order."""
    return tuple(
        action
        for action in Action
        if (status, action) in TRANSITIONS and (not people_only or action in PERSON_ACTIONS)
    )


def next_status(status: AlarmStatus, action: Action) -> AlarmStatus:
    if status is AlarmStatus.SUPERSEDED:
        raise AlarmSupersededError
    target = TRANSITIONS.get((status, action))
    if target is None:
        allowed = allowed_actions(status, people_only=action in PERSON_ACTIONS)
        raise IllegalTransitionError(status, action, allowed)
    return target


class Alarm(AlarmSnapshot, frozen=True, kw_only=True):
    """The alarm: its columns are those of the alarm events' snapshot (protocol/events.py),
    what it is on the wire; its severity and status are the domain's enums."""

    severity: Severity
    status: AlarmStatus


def dedup_key(rule_key: str, device_id: str, telemetry_event_id: str) -> str:
    return f"{rule_key}:{device_id}:{telemetry_event_id}"


def active_key(device_id: str, rule_key: str) -> str:
    return f"{device_id}:{rule_key}"


def apply(
    alarm: Alarm,
    action: Action,
    *,
    actor: str,
    now: datetime,
    superseded_by: int | None = None,
) -> Alarm:
    """The alarm after ``action`` by ``actor`` at ``now``; the caller audits ``actor``.

    People's actions need a person (a non-blank actor not starting with ``system:``); system
    actions need ``system:<what>``. Reaching a terminal state releases the active key.
    """
    if alarm.status is AlarmStatus.SUPERSEDED:
        raise AlarmSupersededError(alarm.superseded_by)
    target = next_status(alarm.status, action)
    _check_actor(action, actor)
    if superseded_by is not None and action is not Action.SUPERSEDE:
        raise ValueError(f"superseded_by is only for {Action.SUPERSEDE}, not {action}")
    changes: dict[str, Any] = _STEP_FIELDS[action](actor, now, superseded_by)
    if target in TERMINAL_STATUSES:
        changes["active_key"] = None
    changed = msgspec.structs.replace(alarm, status=target, **changes)
    check_invariants(changed)
    return changed


def release_active_key(alarm: Alarm) -> Alarm:
    """The refire outcome for an alarm a person is on: status untouched, key released."""
    return msgspec.structs.replace(alarm, active_key=None)


def record_clear(alarm: Alarm, *, clear_event_id: str, now: datetime) -> Alarm:
    """Recovery: an attribute, never a status change. The first clear event wins."""
    if alarm.cleared_at is not None:
        return alarm
    cleared = msgspec.structs.replace(alarm, cleared_at=now, clear_event_id=clear_event_id)
    check_invariants(cleared)
    return cleared


def record_reminder(alarm: Alarm, *, now: datetime) -> Alarm:
    reminded = msgspec.structs.replace(alarm, last_notified_at=now)
    check_invariants(reminded)
    return reminded


def _check_actor(action: Action, actor: str) -> None:
    if action in PERSON_ACTIONS:
        if not actor.strip():
            raise InvalidActorError(action, actor, "a person's action needs a person")
        if actor.startswith(SYSTEM_ACTOR_PREFIX):
            raise InvalidActorError(action, actor, "only people may do this")
    elif not actor.startswith(SYSTEM_ACTOR_PREFIX) or not actor[len(SYSTEM_ACTOR_PREFIX) :]:
        raise InvalidActorError(action, actor, f"a system action needs {SYSTEM_ACTOR_PREFIX}<what>")


_StepFields = Callable[[str, datetime, int | None], dict[str, Any]]
_STEP_FIELDS: Final[Mapping[Action, _StepFields]] = MappingProxyType(
    {
        Action.PUSH: lambda _actor, now, _by: {"pushed_at": now},
        Action.DELAY: lambda _actor, now, _by: {"delayed_at": now},
        Action.WAKE: lambda _actor, now, _by: {"woken_at": now},
        Action.CONFIRM: lambda actor, now, _by: {"confirmed_at": now, "confirmed_by": actor},
        Action.ESCALATE: lambda _actor, now, _by: {"escalated_at": now},
        Action.HANDLE: lambda actor, now, _by: {"handled_at": now, "handled_by": actor},
        Action.CLOSE: lambda actor, now, _by: {"closed_at": now, "closed_by": actor},
        Action.FALSE: lambda actor, now, _by: {"false_at": now, "false_by": actor},
        Action.SUPERSEDE: lambda _actor, now, by: {"superseded_at": now, "superseded_by": by},
    }
)


class RefireOutcome(StrEnum):
    SUPERSEDE = "supersede"
    RELEASE_KEY = "release_key"
    UNTOUCHED = "untouched"


_REFIRE: Final[Mapping[AlarmStatus, RefireOutcome]] = MappingProxyType(
    {
        # Nobody attended: the newer alarm replaces it.
        AlarmStatus.NEW: RefireOutcome.SUPERSEDE,
        AlarmStatus.PUSHED: RefireOutcome.SUPERSEDE,
        AlarmStatus.DELAYED: RefireOutcome.SUPERSEDE,
        # A person is on it: keep its status, only hand the active key to the newer alarm.
        AlarmStatus.CONFIRMED: RefireOutcome.RELEASE_KEY,
        AlarmStatus.ESCALATED: RefireOutcome.RELEASE_KEY,
        AlarmStatus.HANDLED: RefireOutcome.RELEASE_KEY,
        AlarmStatus.CLOSED: RefireOutcome.UNTOUCHED,
        AlarmStatus.FALSE: RefireOutcome.UNTOUCHED,
        AlarmStatus.SUPERSEDED: RefireOutcome.UNTOUCHED,
    }
)


def on_refire(previous: AlarmStatus) -> RefireOutcome:
    """What happens to the alarm holding the active key when its rule fires again."""
    return _REFIRE[previous]


CLEAR_PAIRS: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {
        "DOOR_CLOSE": frozenset({"DOOR_OPEN"}),
        "WATER_LEAK_CLEAR": frozenset({"WATER_LEAK"}),
        "SMOKE_CLEAR": frozenset({"SMOKE"}),
        "SOS_CLEAR": frozenset({"SOS"}),
        "POWER_ON": frozenset({"POWER_OFF", "POWER_CUT"}),
        "POWER_RESTORE": frozenset({"POWER_OFF", "POWER_CUT"}),
    }
)


def clears(clear_event_type: str) -> frozenset[str]:
    """The event types a clear event pairs with (strictly by type; empty if it clears none)."""
    return CLEAR_PAIRS.get(clear_event_type, frozenset())


# --- invariants -------------------------------------------------------------------------------

_Check = Callable[[Alarm], str | None]

_LIFECYCLE_TIMESTAMPS: Final = (
    "pushed_at",
    "delayed_at",
    "woken_at",
    "confirmed_at",
    "escalated_at",
    "handled_at",
    "closed_at",
    "false_at",
    "superseded_at",
    "cleared_at",
    "last_notified_at",
)

# The fields that record each step; a step is "present" when any of its fields is set.
STEP_FIELDS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "pushed": ("pushed_at",),
        "delayed": ("delayed_at",),
        "woken": ("woken_at",),
        "confirmed": ("confirmed_at", "confirmed_by"),
        "escalated": ("escalated_at",),
        "handled": ("handled_at", "handled_by"),
        "closed": ("closed_at", "closed_by"),
        "false": ("false_at", "false_by"),
        "superseded": ("superseded_at", "superseded_by"),
    }
)

_LATER = ("confirmed", "escalated", "handled", "closed", "false", "superseded")
FOREIGN_STEPS: Final[Mapping[AlarmStatus, tuple[str, ...]]] = MappingProxyType(
    {
        AlarmStatus.NEW: ("pushed", *_LATER),
        AlarmStatus.PUSHED: _LATER,
        AlarmStatus.DELAYED: ("pushed", *_LATER),
        AlarmStatus.CONFIRMED: ("handled", "closed", "false", "superseded"),
        AlarmStatus.ESCALATED: ("handled", "closed", "false", "superseded"),
        AlarmStatus.HANDLED: ("closed", "false", "superseded"),
        AlarmStatus.CLOSED: ("false", "superseded"),
        AlarmStatus.FALSE: ("handled", "closed", "superseded"),
        AlarmStatus.SUPERSEDED: ("confirmed", "escalated", "handled", "closed", "false"),
    }
)

# What each state needs of the step(s) that reached it.
REQUIRED_FIELDS: Final[Mapping[AlarmStatus, tuple[str, tuple[str, ...]]]] = MappingProxyType(
    {
        AlarmStatus.PUSHED: ("alarm_pushed_has_timestamp", ("pushed_at",)),
        AlarmStatus.DELAYED: ("alarm_delayed_has_timestamp", ("delayed_at",)),
        AlarmStatus.CONFIRMED: ("alarm_confirmed_has_actor", ("confirmed_at", "confirmed_by")),
        AlarmStatus.ESCALATED: (
            "alarm_escalated_has_actor_and_timestamp",
            ("confirmed_at", "confirmed_by", "escalated_at"),
        ),
        AlarmStatus.HANDLED: ("alarm_handled_has_actor", ("handled_at", "handled_by")),
        AlarmStatus.CLOSED: (
            "alarm_closed_has_actors",
            ("handled_at", "handled_by", "closed_at", "closed_by"),
        ),
        AlarmStatus.FALSE: ("alarm_false_has_actor", ("false_at", "false_by")),
        AlarmStatus.SUPERSEDED: ("alarm_superseded_has_timestamp", ("superseded_at",)),
    }
)


def _blank(text: str) -> bool:
    # btrim() in the table strips spaces only; strip the same so both sides agree.
    return not text.strip(" ")


def _required(status: AlarmStatus, fields: tuple[str, ...]) -> _Check:
    def check(alarm: Alarm) -> str | None:
        if alarm.status is not status:
            return None
        missing = [name for name in fields if getattr(alarm, name) is None]
        return f"{status} alarm lacks {', '.join(missing)}" if missing else None

    return check


def _no_foreign_steps(status: AlarmStatus, steps: tuple[str, ...]) -> _Check:
    def check(alarm: Alarm) -> str | None:
        if alarm.status is not status:
            return None
        found = [
            name for step in steps for name in STEP_FIELDS[step] if getattr(alarm, name) is not None
        ]
        return f"{status} alarm cannot have {', '.join(found)}" if found else None

    return check


def _actor_pair(step: str) -> _Check:
    at_name, by_name = f"{step}_at", f"{step}_by"

    def check(alarm: Alarm) -> str | None:
        at, by = getattr(alarm, at_name), getattr(alarm, by_name)
        if (at is None) != (by is None):
            return f"{at_name} and {by_name} come together ({at_name}={at}, {by_name}={by!r})"
        if by is not None and _blank(by):
            return f"{by_name} is blank"
        return None

    return check


def _active_key_matches(alarm: Alarm) -> str | None:
    expected = active_key(alarm.device_id, alarm.rule_key)
    if alarm.active_key is not None and alarm.active_key != expected:
        return f"active_key {alarm.active_key!r} is not {expected!r}"
    return None


def _active_key_released_when_terminal(alarm: Alarm) -> str | None:
    if alarm.status in TERMINAL_STATUSES and alarm.active_key is not None:
        return f"{alarm.status} alarm still holds active_key {alarm.active_key!r}"
    return None


def _cleared_has_event(alarm: Alarm) -> str | None:
    if (alarm.cleared_at is None) != (alarm.clear_event_id is None):
        return (
            f"cleared_at and clear_event_id come together "
            f"(cleared_at={alarm.cleared_at}, clear_event_id={alarm.clear_event_id!r})"
        )
    if alarm.clear_event_id is not None and _blank(alarm.clear_event_id):
        return "clear_event_id is blank"
    return None


def _dedup_key_matches(alarm: Alarm) -> str | None:
    expected = dedup_key(alarm.rule_key, alarm.device_id, alarm.telemetry_event_id)
    if alarm.dedup_key != expected:
        return f"dedup_key {alarm.dedup_key!r} is not {expected!r}"
    return None


def _delay_ended(alarm: Alarm) -> bool:
    if alarm.delayed_at is None:
        return True
    return alarm.woken_at is not None and alarm.woken_at >= alarm.delayed_at


def _delay_ended_before_push(alarm: Alarm) -> str | None:
    if alarm.pushed_at is not None and not _delay_ended(alarm):
        return (
            f"pushed while delayed (delayed_at={alarm.delayed_at}, woken_at={alarm.woken_at}); "
            "a delay ends with wake before a push"
        )
    return None


def _delay_ended_when_new(alarm: Alarm) -> str | None:
    if alarm.status is AlarmStatus.NEW and not _delay_ended(alarm):
        return (
            f"NEW alarm has delayed_at={alarm.delayed_at} but woken_at={alarm.woken_at}; "
            "DELAYED goes back to NEW only by wake"
        )
    return None


def _escalated_after_confirmed(alarm: Alarm) -> str | None:
    if alarm.escalated_at is not None and alarm.confirmed_at is None:
        return "escalated_at without confirmed_at: only a confirmed alarm escalates"
    return None


def _false_not_while_delayed(alarm: Alarm) -> str | None:
    if alarm.status is AlarmStatus.FALSE and alarm.confirmed_at is None and not _delay_ended(alarm):
        return (
            f"FALSE straight from a delay (delayed_at={alarm.delayed_at}, "
            f"woken_at={alarm.woken_at}): a delayed alarm is confirmed before it is judged false"
        )
    return None


def _not_superseded_by_itself(alarm: Alarm) -> str | None:
    if alarm.superseded_by == alarm.id:
        return f"alarm {alarm.id} cannot supersede itself"
    return None


def _timestamps_not_before_trigger(alarm: Alarm) -> str | None:
    for name in _LIFECYCLE_TIMESTAMPS:
        value: datetime | None = getattr(alarm, name)
        if value is not None and value < alarm.triggered_at:
            return f"{name}={value} is before triggered_at={alarm.triggered_at}"
    return None


def _timestamps_timezone_aware(alarm: Alarm) -> str | None:
    for name in ("triggered_at", *_LIFECYCLE_TIMESTAMPS):
        value: datetime | None = getattr(alarm, name)
        if value is not None and value.utcoffset() is None:
            return f"{name}={value} has no time zone"
    return None


def _woken_after_delayed(alarm: Alarm) -> str | None:
    if alarm.woken_at is not None and alarm.delayed_at is None:
        return "woken_at without delayed_at: only a delayed alarm wakes"
    return None


def _all_invariants() -> dict[str, _Check]:
    checks: dict[str, _Check] = {
        "alarm_active_key_matches": _active_key_matches,
        "alarm_active_key_released_when_terminal": _active_key_released_when_terminal,
        "alarm_cleared_has_event": _cleared_has_event,
        "alarm_dedup_key_matches": _dedup_key_matches,
        "alarm_delay_ended_before_push": _delay_ended_before_push,
        "alarm_delay_ended_when_new": _delay_ended_when_new,
        "alarm_escalated_after_confirmed": _escalated_after_confirmed,
        "alarm_false_not_while_delayed": _false_not_while_delayed,
        "alarm_not_superseded_by_itself": _not_superseded_by_itself,
        "alarm_timestamps_not_before_trigger": _timestamps_not_before_trigger,
        "alarm_woken_after_delayed": _woken_after_delayed,
    }
    for step in ("confirmed", "handled", "closed", "false"):
        checks[f"alarm_{step}_actor_pair"] = _actor_pair(step)
    for status, (name, fields) in REQUIRED_FIELDS.items():
        checks[name] = _required(status, fields)
    for status, steps in FOREIGN_STEPS.items():
        checks[f"alarm_{status.lower()}_has_no_foreign_steps"] = _no_foreign_steps(status, steps)
    return dict(sorted(checks.items()))


# Name order: PostgreSQL applies a table's CHECK constraints sorted by name.
INVARIANTS: Final[Mapping[str, _Check]] = MappingProxyType(_all_invariants())


def check_invariants(alarm: Alarm) -> None:
    """Raise :class:`InvariantError` for the first broken invariant, in constraint name order."""
    # Not a table constraint (timestamptz is always aware); first, since comparing a naive
    # datetime with an aware one raises TypeError.
    problem = _timestamps_timezone_aware(alarm)
    if problem is not None:
        raise InvariantError("alarm_timestamps_timezone_aware", problem)
    for name, check in INVARIANTS.items():
        problem = check(alarm)
        if problem is not None:
            raise InvariantError(name, problem)
