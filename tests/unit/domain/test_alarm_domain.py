"""The alarm aggregate: the whitelist pair by pair, invariants, refire and clear pairing."""

from __future__ import annotations

import itertools
from collections import deque
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.domain.alarm import (
    CLEAR_PAIRS,
    INVARIANTS,
    OPEN_STATUSES,
    PERSON_ACTIONS,
    STEP_FIELDS,
    TERMINAL_STATUSES,
    TRANSITIONS,
    Action,
    Alarm,
    AlarmError,
    AlarmStatus,
    AlarmSupersededError,
    IllegalTransitionError,
    InvalidActorError,
    InvariantError,
    RefireOutcome,
    Severity,
    active_key,
    allowed_actions,
    apply,
    check_invariants,
    clears,
    dedup_key,
    next_status,
    on_refire,
    record_clear,
    record_reminder,
    release_active_key,
)
from gateway.domain.errors import GatewayError

S, A = AlarmStatus, Action
T0 = datetime(2024, 5, 1, 8, 0, tzinfo=UTC)

# docs/behaviour.md §5, written out again here so that a change to the module cannot pass unnoticed.
WHITELIST: dict[tuple[AlarmStatus, Action], AlarmStatus] = {
    (S.NEW, A.PUSH): S.PUSHED,
    (S.NEW, A.DELAY): S.DELAYED,
    (S.NEW, A.CONFIRM): S.CONFIRMED,
    (S.NEW, A.HANDLE): S.HANDLED,
    (S.NEW, A.FALSE): S.FALSE,
    (S.NEW, A.SUPERSEDE): S.SUPERSEDED,
    (S.PUSHED, A.CONFIRM): S.CONFIRMED,
    (S.PUSHED, A.HANDLE): S.HANDLED,
    (S.PUSHED, A.FALSE): S.FALSE,
    (S.PUSHED, A.SUPERSEDE): S.SUPERSEDED,
    (S.DELAYED, A.WAKE): S.NEW,
    (S.DELAYED, A.CONFIRM): S.CONFIRMED,
    (S.DELAYED, A.HANDLE): S.HANDLED,
    (S.DELAYED, A.SUPERSEDE): S.SUPERSEDED,
    (S.CONFIRMED, A.HANDLE): S.HANDLED,
    (S.CONFIRMED, A.ESCALATE): S.ESCALATED,
    (S.CONFIRMED, A.FALSE): S.FALSE,
    (S.ESCALATED, A.CONFIRM): S.CONFIRMED,
    (S.ESCALATED, A.HANDLE): S.HANDLED,
    (S.ESCALATED, A.FALSE): S.FALSE,
    (S.HANDLED, A.CLOSE): S.CLOSED,
}
STEP_TIMESTAMP = {
    A.PUSH: "pushed_at",
    A.DELAY: "delayed_at",
    A.WAKE: "woken_at",
    A.CONFIRM: "confirmed_at",
    A.ESCALATE: "escalated_at",
    A.HANDLE: "handled_at",
    A.CLOSE: "closed_at",
    A.FALSE: "false_at",
    A.SUPERSEDE: "superseded_at",
}
SUCCESSOR_ID = 99


def new_alarm(**changes: Any) -> Alarm:
    alarm = Alarm(
        id=7,
        device_id="dev-1",
        rule_key="door",
        severity=Severity.MAJOR,
        status=S.NEW,
        telemetry_event_id="e" * 64,
        dedup_key=dedup_key("door", "dev-1", "e" * 64),
        active_key=active_key("dev-1", "door"),
        triggered_at=T0,
    )
    return msgspec.structs.replace(alarm, **changes)


def actor_for(action: Action) -> str:
    return "alice" if action in PERSON_ACTIONS else f"system:{action}"


def step(alarm: Alarm, action: Action, now: datetime) -> Alarm:
    successor = SUCCESSOR_ID if action is A.SUPERSEDE else None
    return apply(alarm, action, actor=actor_for(action), now=now, superseded_by=successor)


def shortest_paths() -> dict[AlarmStatus, tuple[Action, ...]]:
    paths: dict[AlarmStatus, tuple[Action, ...]] = {S.NEW: ()}
    queue = deque([S.NEW])
    while queue:
        status = queue.popleft()
        for (source, action), target in WHITELIST.items():
            if source is status and target not in paths:
                paths[target] = (*paths[status], action)
                queue.append(target)
    return paths


PATHS = shortest_paths()


def reach(status: AlarmStatus) -> Alarm:
    alarm = new_alarm()
    for minutes, action in enumerate(PATHS[status], start=1):
        alarm = step(alarm, action, T0 + timedelta(minutes=minutes))
    assert alarm.status is status
    return alarm


# --- the whitelist ------------------------------------------------------------------------------


def test_the_whitelist_is_exactly_spec_section_5() -> None:
    assert dict(TRANSITIONS) == WHITELIST
    assert set(PATHS) == set(AlarmStatus), "every state is reachable from NEW"


def test_status_sets_and_values() -> None:
    assert {s.value for s in AlarmStatus} == {s.name for s in AlarmStatus}
    assert {s.value for s in Severity} == {"INFO", "WARNING", "MAJOR", "CRITICAL"}
    assert {S.NEW, S.PUSHED, S.DELAYED, S.CONFIRMED, S.ESCALATED} == OPEN_STATUSES
    assert {S.CLOSED, S.FALSE, S.SUPERSEDED} == TERMINAL_STATUSES
    assert {A.CONFIRM, A.HANDLE, A.CLOSE, A.FALSE} == PERSON_ACTIONS
    assert [a.value for a in Action] == [
        "confirm",
        "handle",
        "close",
        "false",
        "push",
        "delay",
        "wake",
        "escalate",
        "supersede",
    ]


def expected_allowed(status: AlarmStatus, *, people_only: bool) -> tuple[Action, ...]:
    return tuple(
        a for a in Action if (status, a) in WHITELIST and (a in PERSON_ACTIONS or not people_only)
    )


@pytest.mark.parametrize(
    ("status", "action"),
    list(itertools.product(AlarmStatus, Action)),
    ids=str,
)
def test_every_status_action_pair(status: AlarmStatus, action: Action) -> None:
    alarm = reach(status)
    now = alarm.triggered_at + timedelta(hours=1)
    if status is S.SUPERSEDED:
        with pytest.raises(AlarmSupersededError) as bare:
            next_status(status, action)
        assert bare.value.code == "ALARM_SUPERSEDED"
        with pytest.raises(AlarmSupersededError) as superseded:
            step(alarm, action, now)
        assert superseded.value.superseded_by == SUCCESSOR_ID
        assert f"superseded by alarm {SUCCESSOR_ID}" in str(superseded.value)
        return
    target = WHITELIST.get((status, action))
    if target is None:
        with pytest.raises(IllegalTransitionError) as raised:
            step(alarm, action, now)
        error = raised.value
        assert (error.status, error.action, error.code) == (status, action, "ILLEGAL_TRANSITION")
        people = action in PERSON_ACTIONS
        assert error.allowed == expected_allowed(status, people_only=people)
        with pytest.raises(IllegalTransitionError):
            next_status(status, action)
        return
    assert next_status(status, action) is target
    changed = step(alarm, action, now)
    assert changed.status is target
    check_invariants(changed)
    assert getattr(changed, STEP_TIMESTAMP[action]) == now
    if action in PERSON_ACTIONS:
        assert getattr(changed, step_fields(action)[1]) == "alice"
    if target in TERMINAL_STATUSES:
        assert changed.active_key is None
    else:
        assert changed.active_key == alarm.active_key
    if action is A.SUPERSEDE:
        assert changed.superseded_by == SUCCESSOR_ID
    written = {"status", "active_key", "superseded_by", *step_fields(action)}
    untouched = [f for f in Alarm.__struct_fields__ if f not in written]
    assert [getattr(changed, f) for f in untouched] == [getattr(alarm, f) for f in untouched]


def step_fields(action: Action) -> tuple[str, ...]:
    at = STEP_TIMESTAMP[action]
    return (at, f"{at.removesuffix('_at')}_by") if action in PERSON_ACTIONS else (at,)


@pytest.mark.parametrize("status", list(AlarmStatus))
def test_allowed_actions_follow_declaration_order(status: AlarmStatus) -> None:
    assert allowed_actions(status) == expected_allowed(status, people_only=True)
    assert allowed_actions(status, people_only=False) == expected_allowed(status, people_only=False)


def test_examples_of_allowed_actions() -> None:
    assert allowed_actions(S.NEW) == (A.CONFIRM, A.HANDLE, A.FALSE)
    assert allowed_actions(S.NEW, people_only=False) == (
        A.CONFIRM,
        A.HANDLE,
        A.FALSE,
        A.PUSH,
        A.DELAY,
        A.SUPERSEDE,
    )
    assert allowed_actions(S.DELAYED) == (A.CONFIRM, A.HANDLE)
    assert allowed_actions(S.CONFIRMED, people_only=False) == (A.HANDLE, A.FALSE, A.ESCALATE)
    assert allowed_actions(S.HANDLED) == (A.CLOSE,)


@pytest.mark.parametrize("status", sorted(TERMINAL_STATUSES))
def test_terminal_states_allow_nothing(status: AlarmStatus) -> None:
    assert allowed_actions(status, people_only=False) == ()
    assert all((status, action) not in TRANSITIONS for action in Action)


def test_false_from_delayed_is_refused_and_offers_what_people_can_do() -> None:
    with pytest.raises(IllegalTransitionError) as raised:
        step(reach(S.DELAYED), A.FALSE, T0 + timedelta(hours=1))
    assert raised.value.allowed == (A.CONFIRM, A.HANDLE)
    assert "cannot false an alarm in DELAYED; allowed: confirm, handle" in str(raised.value)


def test_errors_share_the_roots() -> None:
    for error in (IllegalTransitionError, AlarmSupersededError, InvariantError, InvalidActorError):
        assert issubclass(error, AlarmError)
    assert issubclass(AlarmError, GatewayError)
    assert AlarmSupersededError().superseded_by is None


# --- random walks -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    choices=st.lists(st.integers(min_value=0, max_value=20), max_size=30),
    gaps_s=st.lists(st.integers(min_value=0, max_value=7200), min_size=30, max_size=30),
    reminders=st.lists(st.booleans(), min_size=30, max_size=30),
)
def test_random_walks_stay_in_the_whitelist_and_keep_invariants(
    choices: list[int], gaps_s: list[int], reminders: list[bool]
) -> None:
    alarm = new_alarm()
    now = T0
    visited = {alarm.status}
    for choice, gap_s, remind in zip(choices, gaps_s, reminders, strict=False):
        options = allowed_actions(alarm.status, people_only=False)
        if not options:
            assert alarm.status in TERMINAL_STATUSES
            break
        action = options[choice % len(options)]
        now += timedelta(seconds=gap_s)
        before = alarm.status
        alarm = step(alarm, action, now)
        assert alarm.status is WHITELIST[(before, action)]
        check_invariants(alarm)
        visited.add(alarm.status)
        if remind and alarm.status in OPEN_STATUSES:
            alarm = record_reminder(alarm, now=now)
        if alarm.status in TERMINAL_STATUSES:
            assert alarm.active_key is None
    assert visited <= set(AlarmStatus)


def test_a_repeated_delay_keeps_invariants() -> None:
    alarm = new_alarm()
    for minutes, action in enumerate([A.DELAY, A.WAKE, A.DELAY, A.WAKE, A.DELAY], start=1):
        alarm = step(alarm, action, T0 + timedelta(minutes=minutes))
    assert alarm.status is S.DELAYED
    assert alarm.woken_at is not None
    assert alarm.delayed_at is not None
    assert alarm.woken_at < alarm.delayed_at
    confirmed = step(alarm, A.CONFIRM, T0 + timedelta(minutes=9))
    assert step(confirmed, A.FALSE, T0 + timedelta(minutes=10)).status is S.FALSE
    woken = step(alarm, A.WAKE, T0 + timedelta(minutes=9))
    assert step(woken, A.PUSH, T0 + timedelta(minutes=10)).status is S.PUSHED


def test_reconfirming_after_escalation_names_the_new_person() -> None:
    escalated = reach(S.ESCALATED)
    again = apply(escalated, A.CONFIRM, actor="bob", now=T0 + timedelta(hours=2))
    assert (again.status, again.confirmed_by, again.escalated_at) == (
        S.CONFIRMED,
        "bob",
        escalated.escalated_at,
    )


# --- the invariants accept exactly what the whitelist can reach ------------------------------


def step_pattern(alarm: Alarm) -> tuple[AlarmStatus, frozenset[str]]:
    present = frozenset(
        name
        for name, fields in STEP_FIELDS.items()
        if any(getattr(alarm, f) is not None for f in fields)
    )
    return alarm.status, present


def reachable_patterns(depth: int) -> set[tuple[AlarmStatus, frozenset[str]]]:
    found: set[tuple[AlarmStatus, frozenset[str]]] = set()
    frontier = [new_alarm()]
    for minute in range(1, depth + 1):
        following: list[Alarm] = []
        for alarm in frontier:
            found.add(step_pattern(alarm))
            following.extend(
                step(alarm, action, T0 + timedelta(minutes=minute))
                for action in allowed_actions(alarm.status, people_only=False)
            )
        frontier = following
    return found


def test_invariants_accept_exactly_the_reachable_step_patterns() -> None:
    reachable = reachable_patterns(depth=9)
    assert reachable == reachable_patterns(depth=10), "depth 9 already reaches every pattern"
    steps = list(STEP_FIELDS)
    accepted = set()
    for status in AlarmStatus:
        for size in range(len(steps) + 1):
            for combo in itertools.combinations(steps, size):
                # Steps stamped in the order they can happen: a wake follows its delay.
                fields: dict[str, Any] = {}
                for order, name in enumerate(combo, start=1):
                    for field in STEP_FIELDS[name]:
                        fields[field] = T0 + timedelta(minutes=order)
                    if name in ("confirmed", "handled", "closed", "false"):
                        fields[f"{name}_by"] = "alice"
                    if name == "superseded":
                        fields["superseded_by"] = SUCCESSOR_ID
                alarm = new_alarm(status=status, active_key=None, **fields)
                try:
                    check_invariants(alarm)
                except InvariantError:
                    continue
                accepted.add(step_pattern(alarm))
    assert accepted == reachable


# --- invariants one by one ----------------------------------------------------------------------

LATER = T0 + timedelta(minutes=5)
EARLIER = T0 - timedelta(seconds=1)

# (invariant, a reachable alarm, the change that breaks only that invariant)
BROKEN: list[tuple[str, AlarmStatus, dict[str, Any]]] = [
    ("alarm_active_key_matches", S.NEW, {"active_key": "dev-1:other"}),
    ("alarm_active_key_released_when_terminal", S.CLOSED, {"active_key": "dev-1:door"}),
    ("alarm_cleared_has_event", S.NEW, {"cleared_at": LATER}),
    ("alarm_cleared_has_event", S.NEW, {"clear_event_id": "c1"}),
    ("alarm_cleared_has_event", S.NEW, {"cleared_at": LATER, "clear_event_id": " "}),
    ("alarm_closed_actor_pair", S.CLOSED, {"closed_by": None}),
    ("alarm_closed_has_actors", S.CLOSED, {"closed_at": None, "closed_by": None}),
    ("alarm_closed_has_no_foreign_steps", S.CLOSED, {"false_at": LATER, "false_by": "x"}),
    ("alarm_confirmed_actor_pair", S.CONFIRMED, {"confirmed_by": ""}),
    ("alarm_confirmed_actor_pair", S.CONFIRMED, {"confirmed_at": None}),
    ("alarm_confirmed_has_actor", S.CONFIRMED, {"confirmed_at": None, "confirmed_by": None}),
    ("alarm_confirmed_has_no_foreign_steps", S.CONFIRMED, {"superseded_by": 1}),
    ("alarm_dedup_key_matches", S.NEW, {"dedup_key": "door:dev-1:other"}),
    ("alarm_delay_ended_before_push", S.PUSHED, {"delayed_at": LATER}),
    ("alarm_delay_ended_when_new", S.NEW, {"delayed_at": LATER}),
    ("alarm_delayed_has_no_foreign_steps", S.DELAYED, {"false_at": LATER, "false_by": "x"}),
    ("alarm_delayed_has_timestamp", S.DELAYED, {"delayed_at": None}),
    ("alarm_escalated_after_confirmed", S.HANDLED, {"escalated_at": LATER}),
    ("alarm_escalated_has_actor_and_timestamp", S.ESCALATED, {"escalated_at": None}),
    ("alarm_escalated_has_no_foreign_steps", S.ESCALATED, {"handled_at": LATER, "handled_by": "x"}),
    ("alarm_false_actor_pair", S.FALSE, {"false_by": None}),
    ("alarm_false_has_actor", S.FALSE, {"false_at": None, "false_by": None}),
    ("alarm_false_has_no_foreign_steps", S.FALSE, {"closed_at": LATER, "closed_by": "x"}),
    ("alarm_false_not_while_delayed", S.FALSE, {"delayed_at": LATER}),
    ("alarm_handled_actor_pair", S.HANDLED, {"handled_by": "   "}),
    ("alarm_handled_has_actor", S.HANDLED, {"handled_at": None, "handled_by": None}),
    ("alarm_handled_has_no_foreign_steps", S.HANDLED, {"superseded_at": LATER}),
    ("alarm_new_has_no_foreign_steps", S.NEW, {"pushed_at": LATER}),
    (
        "alarm_new_has_no_foreign_steps",
        S.NEW,
        {"escalated_at": LATER, "confirmed_at": LATER, "confirmed_by": "x"},
    ),
    ("alarm_not_superseded_by_itself", S.SUPERSEDED, {"superseded_by": 7}),
    ("alarm_pushed_has_no_foreign_steps", S.PUSHED, {"false_at": LATER, "false_by": "x"}),
    ("alarm_pushed_has_timestamp", S.PUSHED, {"pushed_at": None}),
    (
        "alarm_superseded_has_no_foreign_steps",
        S.SUPERSEDED,
        {"confirmed_at": LATER, "confirmed_by": "x"},
    ),
    (
        "alarm_superseded_has_timestamp",
        S.SUPERSEDED,
        {"superseded_at": None, "superseded_by": None},
    ),
    ("alarm_timestamps_not_before_trigger", S.NEW, {"last_notified_at": EARLIER}),
    ("alarm_timestamps_not_before_trigger", S.CLOSED, {"closed_at": EARLIER}),
    ("alarm_timestamps_timezone_aware", S.NEW, {"triggered_at": T0.replace(tzinfo=None)}),
    ("alarm_woken_after_delayed", S.CONFIRMED, {"woken_at": LATER}),
]


@pytest.mark.parametrize(("invariant", "status", "changes"), BROKEN)
def test_each_invariant_is_enforced(
    invariant: str, status: AlarmStatus, changes: dict[str, Any]
) -> None:
    alarm = reach(status)
    check_invariants(alarm)
    with pytest.raises(InvariantError) as raised:
        check_invariants(msgspec.structs.replace(alarm, **changes))
    assert raised.value.invariant == invariant
    assert str(raised.value).startswith(f"{invariant}: ")


def test_every_invariant_has_a_breaking_example() -> None:
    assert {name for name, _, _ in BROKEN} == {*INVARIANTS, "alarm_timestamps_timezone_aware"}
    assert list(INVARIANTS) == sorted(INVARIANTS), "the table's CHECK order"


def test_superseded_by_may_follow_a_moment_later() -> None:
    alarm = apply(reach(S.PUSHED), A.SUPERSEDE, actor="system:refire", now=LATER)
    assert (alarm.status, alarm.superseded_by, alarm.active_key) == (S.SUPERSEDED, None, None)


# --- apply's preconditions ----------------------------------------------------------------------


@pytest.mark.parametrize("actor", ["", " ", "\t\n"])
@pytest.mark.parametrize("action", sorted(PERSON_ACTIONS))
def test_people_actions_need_a_person(action: Action, actor: str) -> None:
    alarm = reach(next(s for s, a in WHITELIST if a is action))
    with pytest.raises(InvalidActorError) as raised:
        apply(alarm, action, actor=actor, now=LATER)
    assert (raised.value.action, raised.value.actor, raised.value.code) == (
        action,
        actor,
        "INVALID_ACTOR",
    )


def test_people_actions_refuse_the_system_and_system_actions_refuse_people() -> None:
    with pytest.raises(InvalidActorError, match="only people"):
        apply(new_alarm(), A.CONFIRM, actor="system:notifier", now=LATER)
    with pytest.raises(InvalidActorError, match="system:<what>"):
        apply(new_alarm(), A.PUSH, actor="alice", now=LATER)
    with pytest.raises(InvalidActorError, match="system:<what>"):
        apply(new_alarm(), A.PUSH, actor="system:", now=LATER)
    assert apply(new_alarm(), A.PUSH, actor="system:notifier", now=LATER).status is S.PUSHED


def test_illegal_transition_is_reported_before_a_bad_actor() -> None:
    with pytest.raises(IllegalTransitionError):
        apply(reach(S.HANDLED), A.CONFIRM, actor="", now=LATER)


@pytest.mark.parametrize("status", sorted(set(AlarmStatus) - TERMINAL_STATUSES))
def test_a_step_before_the_trigger_is_refused(status: AlarmStatus) -> None:
    alarm = reach(status)
    action = allowed_actions(status, people_only=False)[0]
    with pytest.raises(InvariantError) as raised:
        apply(alarm, action, actor=actor_for(action), now=EARLIER)
    assert raised.value.invariant == "alarm_timestamps_not_before_trigger"
    assert "before triggered_at" in raised.value.message


def test_a_naive_now_is_refused() -> None:
    with pytest.raises(InvariantError) as raised:
        apply(new_alarm(), A.PUSH, actor="system:notifier", now=LATER.replace(tzinfo=None))
    assert raised.value.invariant == "alarm_timestamps_timezone_aware"


def test_other_time_zones_compare_as_instants() -> None:
    tokyo = timezone(timedelta(hours=9))
    pushed = apply(new_alarm(), A.PUSH, actor="system:notifier", now=LATER.astimezone(tokyo))
    check_invariants(pushed)


def test_superseded_by_is_only_for_supersede() -> None:
    with pytest.raises(ValueError, match="superseded_by"):
        apply(new_alarm(), A.PUSH, actor="system:notifier", now=LATER, superseded_by=3)
    with pytest.raises(InvariantError) as raised:
        apply(new_alarm(), A.SUPERSEDE, actor="system:refire", now=LATER, superseded_by=7)
    assert raised.value.invariant == "alarm_not_superseded_by_itself"


def test_apply_does_not_mutate_its_input() -> None:
    alarm = new_alarm()
    apply(alarm, A.CONFIRM, actor="alice", now=LATER)
    assert alarm == new_alarm()


# --- keys, refire, recovery, reminders ----------------------------------------------------------


def test_keys() -> None:
    assert dedup_key("door", "dev-1", "abc") == "door:dev-1:abc"
    assert active_key("dev-1", "door") == "dev-1:door"


@pytest.mark.parametrize(
    ("previous", "outcome"),
    [
        (S.NEW, RefireOutcome.SUPERSEDE),
        (S.PUSHED, RefireOutcome.SUPERSEDE),
        (S.DELAYED, RefireOutcome.SUPERSEDE),
        (S.CONFIRMED, RefireOutcome.RELEASE_KEY),
        (S.ESCALATED, RefireOutcome.RELEASE_KEY),
        (S.HANDLED, RefireOutcome.RELEASE_KEY),
        (S.CLOSED, RefireOutcome.UNTOUCHED),
        (S.FALSE, RefireOutcome.UNTOUCHED),
        (S.SUPERSEDED, RefireOutcome.UNTOUCHED),
    ],
)
def test_on_refire(previous: AlarmStatus, outcome: RefireOutcome) -> None:
    assert on_refire(previous) is outcome
    if outcome is RefireOutcome.SUPERSEDE:
        assert (previous, A.SUPERSEDE) in TRANSITIONS
    if outcome is RefireOutcome.RELEASE_KEY:
        released = release_active_key(reach(previous))
        assert (released.status, released.active_key) == (previous, None)
        check_invariants(released)


def test_refire_outcome_values() -> None:
    assert [o.value for o in RefireOutcome] == ["supersede", "release_key", "untouched"]


def test_clear_pairs_are_strict_by_type() -> None:
    assert dict(CLEAR_PAIRS) == {
        "DOOR_CLOSE": {"DOOR_OPEN"},
        "WATER_LEAK_CLEAR": {"WATER_LEAK"},
        "SMOKE_CLEAR": {"SMOKE"},
        "SOS_CLEAR": {"SOS"},
        "POWER_ON": {"POWER_OFF", "POWER_CUT"},
        "POWER_RESTORE": {"POWER_OFF", "POWER_CUT"},
    }
    assert clears("DOOR_CLOSE") == {"DOOR_OPEN"}
    assert "SOS" not in clears("POWER_ON")
    assert clears("POWER_RESTORE") == {"POWER_OFF", "POWER_CUT"}
    for unknown in ("DOOR_OPEN", "SOS", "door_close", "", "CLEAR"):
        assert clears(unknown) == frozenset()
    every_cleared = {t for types in CLEAR_PAIRS.values() for t in types}
    assert not every_cleared & set(CLEAR_PAIRS), "a clear event never clears a clear event"


@pytest.mark.parametrize("status", list(AlarmStatus))
def test_recovery_is_an_attribute_never_a_status(status: AlarmStatus) -> None:
    alarm = reach(status)
    cleared = record_clear(alarm, clear_event_id="c" * 64, now=LATER)
    assert cleared.status is status
    assert (cleared.cleared_at, cleared.clear_event_id) == (LATER, "c" * 64)
    again = record_clear(cleared, clear_event_id="d" * 64, now=LATER + timedelta(minutes=1))
    assert again == cleared, "the first clear event wins"
    with pytest.raises(InvariantError):
        record_clear(alarm, clear_event_id="c", now=EARLIER)


def test_reminders_change_no_state() -> None:
    pushed = reach(S.PUSHED)
    reminded = record_reminder(pushed, now=LATER)
    assert reminded == msgspec.structs.replace(pushed, last_notified_at=LATER)
    with pytest.raises(InvariantError):
        record_reminder(pushed, now=EARLIER)
