"""The alarm table enforces the domain's invariants: same rules, same names, real PostgreSQL."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
import pytest

from gateway.domain.alarm import (
    INVARIANTS,
    OPEN_STATUSES,
    PERSON_ACTIONS,
    Action,
    Alarm,
    AlarmStatus,
    InvariantError,
    Severity,
    active_key,
    allowed_actions,
    apply,
    check_invariants,
    dedup_key,
    next_status,
    record_clear,
    record_reminder,
)
from storage import alarms as alarm_repo
from tests.support.plans import plan_nodes

S, A = AlarmStatus, Action
T0 = datetime(2024, 5, 1, 8, 0, tzinfo=UTC)
LATER = T0 + timedelta(minutes=30)
EARLIER = T0 - timedelta(seconds=1)
ANCHOR_ID = 1  # an existing alarm for superseded_by to point at

INSERT = """
INSERT INTO alarm (
    id, device_id, rule_key, severity, status, telemetry_event_id, dedup_key, active_key,
    triggered_at, pushed_at, delayed_at, woken_at, confirmed_at, confirmed_by, escalated_at,
    handled_at, handled_by, closed_at, closed_by, false_at, false_by, superseded_at,
    superseded_by, cleared_at, clear_event_id, last_notified_at, trigger, rule_description,
    node_id
) VALUES (
    $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20,
    $21, $22, $23, $24, $25, $26, $27::jsonb, $28, $29
)
"""
COLUMNS = Alarm.__struct_fields__  # the order of INSERT's columns


def args(alarm: Alarm, node_id: str = "node-a") -> tuple[Any, ...]:
    return (*(getattr(alarm, name) for name in COLUMNS), node_id)


def new_alarm(alarm_id: int, *, device_id: str | None = None, event: str = "e") -> Alarm:
    device = device_id or f"dev-{alarm_id}"
    event_id = f"{event}{alarm_id}"
    return Alarm(
        id=alarm_id,
        device_id=device,
        rule_key="door",
        severity=Severity.CRITICAL,
        status=S.NEW,
        telemetry_event_id=event_id,
        dedup_key=dedup_key("door", device, event_id),
        active_key=active_key(device, "door"),
        triggered_at=T0,
    )


def step(alarm: Alarm, action: Action, now: datetime) -> Alarm:
    actor = "alice" if action in PERSON_ACTIONS else f"system:{action}"
    successor = ANCHOR_ID if action is A.SUPERSEDE else None
    return apply(alarm, action, actor=actor, now=now, superseded_by=successor)


def paths(depth: int) -> Iterator[tuple[Action, ...]]:
    """Every sequence of whitelisted actions from NEW of at most ``depth`` steps."""
    frontier: list[tuple[AlarmStatus, tuple[Action, ...]]] = [(S.NEW, ())]
    for _ in range(depth + 1):
        following: list[tuple[AlarmStatus, tuple[Action, ...]]] = []
        for status, path in frontier:
            yield path
            following.extend(
                (next_status(status, action), (*path, action))
                for action in allowed_actions(status, people_only=False)
            )
        frontier = following


def walk(alarm: Alarm, path: tuple[Action, ...]) -> Alarm:
    for minute, action in enumerate(path, start=1):
        alarm = step(alarm, action, T0 + timedelta(minutes=minute))
    return alarm


def reach(alarm_id: int, status: AlarmStatus) -> Alarm:
    path = next(p for p in paths(4) if walk(new_alarm(0), p).status is status)
    return walk(new_alarm(alarm_id), path)


async def insert_anchor(db: asyncpg.Connection) -> None:
    await db.execute(INSERT, *args(walk(new_alarm(ANCHOR_ID, event="anchor"), (A.FALSE,))))


async def test_columns_match_the_struct(db: asyncpg.Connection) -> None:
    columns = [
        r["column_name"]
        for r in await db.fetch(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'alarm' ORDER BY ordinal_position"
        )
    ]
    # Migration 0010 added why an alarm fired: at the end of the table. Migration 0020 added
    # when the timers found it unreached: their bookkeeping (once per alarm), not the domain's.
    # Migration 0056 the transaction that created it: the desk's (a bulk action as read).
    # Migration 0058 why the rule fired: the AI worker's (its creation event is pruned).
    added = ["trigger", "rule_description"]
    first = [f for f in Alarm.__struct_fields__ if f not in added]
    assert columns == [
        *first, "created_at", "node_id", *added, "unreached_at", "created_xid", "reason"
    ]  # fmt: skip


async def test_every_check_constraint_is_a_domain_invariant(db: asyncpg.Connection) -> None:
    checks = {
        r["conname"]
        for r in await db.fetch(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'alarm'::regclass AND contype = 'c'"
        )
    }
    assert checks == {*INVARIANTS, "alarm_status_valid", "alarm_severity_valid"}


async def test_rows_from_every_reachable_path_are_accepted_and_read_back(
    db: asyncpg.Connection,
) -> None:
    await insert_anchor(db)
    alarms = []
    for alarm_id, path in enumerate(paths(10), start=ANCHOR_ID + 1):
        alarm = walk(new_alarm(alarm_id), path)
        if alarm_id % 3 == 0:
            alarm = record_clear(alarm, clear_event_id=f"clear{alarm_id}", now=LATER)
        if alarm_id % 5 == 0:
            alarm = record_reminder(alarm, now=LATER)
        alarms.append(alarm)
    assert {a.status for a in alarms} == set(AlarmStatus)
    assert len(alarms) == 331
    await db.executemany(INSERT, [args(a) for a in alarms])
    rows = await db.fetch("SELECT * FROM alarm WHERE id > $1 ORDER BY id", ANCHOR_ID)
    read_back = [{k: v for k, v in r.items() if k in COLUMNS} for r in rows]
    assert [msgspec.convert(r, Alarm) for r in read_back] == alarms
    assert {r["node_id"] for r in rows} == {"node-a"}


# (constraint, a reachable state, the change that breaks only that constraint)
BROKEN: list[tuple[str, AlarmStatus, dict[str, Any]]] = [
    ("alarm_active_key_matches", S.NEW, {"active_key": "dev-9:other"}),
    ("alarm_active_key_released_when_terminal", S.CLOSED, {"active_key": "dev-9:door"}),
    ("alarm_active_key_released_when_terminal", S.SUPERSEDED, {"active_key": "dev-9:door"}),
    ("alarm_cleared_has_event", S.NEW, {"cleared_at": LATER}),
    ("alarm_cleared_has_event", S.HANDLED, {"clear_event_id": "c1"}),
    ("alarm_cleared_has_event", S.NEW, {"cleared_at": LATER, "clear_event_id": "  "}),
    ("alarm_closed_actor_pair", S.CLOSED, {"closed_by": None}),
    ("alarm_closed_actor_pair", S.CLOSED, {"closed_by": ""}),
    ("alarm_closed_has_actors", S.CLOSED, {"closed_at": None, "closed_by": None}),
    ("alarm_closed_has_actors", S.CLOSED, {"handled_at": None, "handled_by": None}),
    ("alarm_closed_has_no_foreign_steps", S.CLOSED, {"false_at": LATER, "false_by": "x"}),
    ("alarm_confirmed_actor_pair", S.CONFIRMED, {"confirmed_by": " "}),
    ("alarm_confirmed_actor_pair", S.ESCALATED, {"confirmed_at": None}),
    ("alarm_confirmed_has_actor", S.CONFIRMED, {"confirmed_at": None, "confirmed_by": None}),
    ("alarm_confirmed_has_no_foreign_steps", S.CONFIRMED, {"superseded_by": ANCHOR_ID}),
    ("alarm_dedup_key_matches", S.NEW, {"dedup_key": "door:dev-9:other"}),
    ("alarm_delay_ended_before_push", S.PUSHED, {"delayed_at": LATER}),
    ("alarm_delay_ended_before_push", S.HANDLED, {"pushed_at": LATER, "delayed_at": LATER}),
    ("alarm_delay_ended_when_new", S.NEW, {"delayed_at": LATER}),
    ("alarm_delayed_has_no_foreign_steps", S.DELAYED, {"false_at": LATER, "false_by": "x"}),
    ("alarm_delayed_has_no_foreign_steps", S.DELAYED, {"superseded_by": ANCHOR_ID}),
    ("alarm_delayed_has_timestamp", S.DELAYED, {"delayed_at": None}),
    ("alarm_escalated_after_confirmed", S.HANDLED, {"escalated_at": LATER}),
    ("alarm_escalated_has_actor_and_timestamp", S.ESCALATED, {"escalated_at": None}),
    (
        "alarm_escalated_has_actor_and_timestamp",
        S.ESCALATED,
        {"confirmed_at": None, "confirmed_by": None, "escalated_at": None},
    ),
    ("alarm_escalated_has_no_foreign_steps", S.ESCALATED, {"handled_at": LATER, "handled_by": "x"}),
    ("alarm_false_actor_pair", S.FALSE, {"false_by": None}),
    ("alarm_false_has_actor", S.FALSE, {"false_at": None, "false_by": None}),
    ("alarm_false_has_no_foreign_steps", S.FALSE, {"closed_at": LATER, "closed_by": "x"}),
    ("alarm_false_not_while_delayed", S.FALSE, {"delayed_at": LATER}),
    ("alarm_handled_actor_pair", S.HANDLED, {"handled_by": "   "}),
    ("alarm_handled_has_actor", S.HANDLED, {"handled_at": None, "handled_by": None}),
    ("alarm_handled_has_no_foreign_steps", S.HANDLED, {"superseded_at": LATER}),
    ("alarm_new_has_no_foreign_steps", S.NEW, {"pushed_at": LATER}),
    ("alarm_new_has_no_foreign_steps", S.NEW, {"superseded_at": LATER}),
    ("alarm_new_has_no_foreign_steps", S.NEW, {"confirmed_at": LATER, "confirmed_by": "x"}),
    ("alarm_not_superseded_by_itself", S.SUPERSEDED, {"superseded_by": "self"}),
    ("alarm_pushed_has_no_foreign_steps", S.PUSHED, {"false_at": LATER, "false_by": "x"}),
    ("alarm_pushed_has_timestamp", S.PUSHED, {"pushed_at": None}),
    (
        "alarm_superseded_has_no_foreign_steps",
        S.SUPERSEDED,
        {"confirmed_at": LATER, "confirmed_by": "x"},
    ),
    ("alarm_superseded_has_timestamp", S.SUPERSEDED, {"superseded_at": None}),
    ("alarm_timestamps_not_before_trigger", S.NEW, {"last_notified_at": EARLIER}),
    ("alarm_timestamps_not_before_trigger", S.CLOSED, {"closed_at": EARLIER}),
    ("alarm_timestamps_not_before_trigger", S.PUSHED, {"pushed_at": EARLIER}),
    (
        "alarm_timestamps_not_before_trigger",
        S.NEW,
        {"cleared_at": EARLIER, "clear_event_id": "c"},
    ),
    ("alarm_woken_after_delayed", S.CONFIRMED, {"woken_at": LATER}),
]


def test_every_constraint_has_a_breaking_row() -> None:
    assert {name for name, _, _ in BROKEN} == set(INVARIANTS)


@pytest.mark.parametrize(("constraint", "status", "changes"), BROKEN)
async def test_rows_breaking_an_invariant_are_rejected_by_its_check(
    db: asyncpg.Connection, constraint: str, status: AlarmStatus, changes: dict[str, Any]
) -> None:
    await insert_anchor(db)
    good = reach(9, status)
    if changes.get("superseded_by") == "self":
        changes = {**changes, "superseded_by": good.id}
    bad = msgspec.structs.replace(good, **changes)
    with pytest.raises(InvariantError) as domain:
        check_invariants(bad)
    assert domain.value.invariant == constraint
    with pytest.raises(asyncpg.CheckViolationError) as table:
        await db.execute(INSERT, *args(bad))
    assert table.value.constraint_name == constraint
    await db.execute(INSERT, *args(good))


async def test_unknown_status_and_severity_are_rejected(db: asyncpg.Connection) -> None:
    row = list(args(new_alarm(5)))
    for index, value, constraint in [
        (4, "OPEN", "alarm_status_valid"),
        (4, "new", "alarm_status_valid"),
        (3, "FATAL", "alarm_severity_valid"),
    ]:
        broken = list(row)
        broken[index] = value
        with pytest.raises(asyncpg.CheckViolationError) as raised:
            await db.execute(INSERT, *broken)
        assert raised.value.constraint_name == constraint


def mutate(alarm: Alarm, rng: random.Random) -> Alarm:
    """One to three random edits, most of them breaking something, some harmless."""
    timestamps = [
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
    ]
    actors = ["confirmed_by", "handled_by", "closed_by", "false_by"]
    changes: dict[str, Any] = {}
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6)
        if kind == 0:
            offset_s = rng.choice([-60, 0, 60, 600, 3600])
            changes[rng.choice(timestamps)] = rng.choice([None, T0 + timedelta(seconds=offset_s)])
        elif kind == 1:
            changes[rng.choice(actors)] = rng.choice([None, "", " ", "bob"])
        elif kind == 2:
            changes["status"] = rng.choice(list(AlarmStatus))
        elif kind == 3:
            correct = active_key(alarm.device_id, alarm.rule_key)
            changes["active_key"] = rng.choice([None, correct, correct + "x"])
        elif kind == 4:
            changes["superseded_by"] = rng.choice([None, ANCHOR_ID, alarm.id])
        else:
            changes["clear_event_id"] = rng.choice([None, "c", " "])
    if rng.random() < 0.05:
        changes["dedup_key"] = alarm.dedup_key + "x"
    return msgspec.structs.replace(alarm, **changes)


async def test_domain_and_table_agree_on_random_rows(db: asyncpg.Connection) -> None:
    await insert_anchor(db)
    rng = random.Random(20240501)
    reachable = [walk(new_alarm(0), p) for p in paths(6)]
    verdicts: dict[str, int] = {}
    for alarm_id in range(ANCHOR_ID + 1, 1500):
        base = rng.choice(reachable)
        device = f"dev-{alarm_id}"
        base = msgspec.structs.replace(
            base,
            id=alarm_id,
            device_id=device,
            telemetry_event_id=f"e{alarm_id}",
            dedup_key=dedup_key(base.rule_key, device, f"e{alarm_id}"),
            active_key=None if base.active_key is None else active_key(device, base.rule_key),
        )
        candidate = mutate(base, rng)
        try:
            check_invariants(candidate)
        except InvariantError as error:
            expected: str = error.invariant
        else:
            expected = "accepted"
        try:
            async with db.transaction():
                await db.execute(INSERT, *args(candidate))
        except asyncpg.CheckViolationError as error:
            actual = error.constraint_name
        else:
            actual = "accepted"
        assert actual == expected, candidate
        verdicts[actual] = verdicts.get(actual, 0) + 1
    assert verdicts["accepted"] > 100
    assert len(verdicts) > 25, verdicts


async def test_dedup_key_is_unique(db: asyncpg.Connection) -> None:
    first = new_alarm(10)
    await db.execute(INSERT, *args(first))
    replay = msgspec.structs.replace(first, id=11, active_key=None)
    with pytest.raises(asyncpg.UniqueViolationError) as raised:
        await db.execute(INSERT, *args(replay))
    assert raised.value.constraint_name == "alarm_dedup_key_unique"


async def test_one_active_alarm_per_device_and_rule(db: asyncpg.Connection) -> None:
    await db.execute(INSERT, *args(new_alarm(20, device_id="dev-x", event="a")))
    held = walk(new_alarm(21, device_id="dev-x", event="b"), (A.CONFIRM,))
    assert held.status in OPEN_STATUSES
    with pytest.raises(asyncpg.UniqueViolationError) as raised:
        await db.execute(INSERT, *args(held))
    assert raised.value.constraint_name == "alarm_active_key_unique"
    released = [
        msgspec.structs.replace(new_alarm(alarm_id, device_id="dev-x", event="c"), active_key=None)
        for alarm_id in range(30, 35)
    ]
    await db.executemany(INSERT, [args(a) for a in released])
    count = await db.fetchval("SELECT count(*) FROM alarm WHERE device_id = 'dev-x'")
    assert count == 6


async def test_refire_order_release_insert_then_link(db: asyncpg.Connection) -> None:
    """docs/behaviour.md §5: release the old key → insert the new alarm → fill superseded_by."""
    old = walk(new_alarm(40, device_id="dev-r", event="a"), (A.PUSH,))
    await db.execute(INSERT, *args(old))
    new = new_alarm(41, device_id="dev-r", event="b")
    async with db.transaction():
        with pytest.raises(asyncpg.UniqueViolationError):
            async with db.transaction():
                await db.execute(INSERT, *args(new))  # the key is still held
        superseded = apply(old, A.SUPERSEDE, actor="system:refire", now=LATER)
        changed = await db.execute(
            "UPDATE alarm SET status = $2, superseded_at = $3, active_key = NULL "
            "WHERE id = $1 AND status = $4",
            old.id,
            superseded.status,
            superseded.superseded_at,
            old.status,
        )
        assert changed == "UPDATE 1"
        await db.execute(INSERT, *args(new))
        await db.execute("UPDATE alarm SET superseded_by = $2 WHERE id = $1", old.id, new.id)
    row = await db.fetchrow("SELECT status, superseded_by, active_key FROM alarm WHERE id = 40")
    assert dict(row) == {"status": "SUPERSEDED", "superseded_by": 41, "active_key": None}
    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await db.execute("UPDATE alarm SET superseded_by = 999 WHERE id = 40")


async def test_chain_walks_backwards_through_superseded_by(db: asyncpg.Connection) -> None:
    # 1→2→3 superseded in turn, 3 current: the chain of 3 is [1, 2, 3] (behaviour §5 example).
    first, second, third = (new_alarm(i, device_id=f"dev-c{i}") for i in (51, 52, 53))
    await db.execute(INSERT, *args(third))
    for alarm, successor in ((second, third), (first, second)):
        superseded = apply(
            alarm, A.SUPERSEDE, actor="system:refire", now=LATER, superseded_by=successor.id
        )
        await db.execute(INSERT, *args(superseded))
    chain = await db.fetch(
        """
        WITH RECURSIVE chain AS (
            SELECT id FROM alarm WHERE id = $1
            UNION ALL
            SELECT a.id FROM alarm a JOIN chain c ON a.superseded_by = c.id
        )
        SELECT id FROM chain ORDER BY id
        """,
        53,
    )
    assert [r["id"] for r in chain] == [51, 52, 53]


async def test_a_late_clear_finds_its_alarm_by_the_trigger_time_with_the_sample_pruned(
    db: asyncpg.Connection,
) -> None:
    """clear_raised_by picks the newest alarm raised at or before the clear's device time from
    the trigger's `sample_ts`: no telemetry row is needed (here there is none, as after the
    retention pruned the sample's day)."""
    for alarm_id, seconds in ((50, 10), (51, 30)):
        alarm = msgspec.structs.replace(
            new_alarm(alarm_id, device_id="dev-late", event=f"x{alarm_id}"), active_key=None
        )
        await db.execute(INSERT, *args(alarm))
        at = (T0 + timedelta(seconds=seconds)).isoformat()
        await db.execute(
            "UPDATE alarm SET trigger = $2::jsonb WHERE id = $1",
            alarm_id,
            msgspec.json.encode({"event": "DOOR_OPEN", "sample_ts": at}).decode(),
        )
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 0
    row = await alarm_repo.clear_raised_by(
        db, device_id="dev-late", rule_key="door", device_time=T0 + timedelta(seconds=20),
        at=LATER, clear_event_id="clear-1",
    )  # fmt: skip
    assert row is not None
    assert row["id"] == 50  # raised at +10 s; the one of +30 s came after the clear's time
    again = await alarm_repo.clear_raised_by(
        db, device_id="dev-late", rule_key="door", device_time=T0 + timedelta(seconds=20),
        at=LATER, clear_event_id="clear-2",
    )  # fmt: skip
    assert again is None  # cleared already


async def test_the_unreached_pass_finds_its_rows_once_however_many_alarms_are_open(
    db: asyncpg.Connection,
) -> None:
    """With statistics taken while the table was empty (a storm after a quiet spell), the pass
    must not run its locking search again for every open NEW alarm: it did, 206 ms a pass with
    1,001 open and none due. Every node of its plan runs once, due rows or none."""
    from gateway.alarms.lifecycle import create_alarm

    await db.execute("ANALYZE alarm")
    now = await alarm_repo.db_now(db)
    async with db.transaction():
        for n in range(300):
            await create_alarm(
                db, device_id=f"dev-{n}", rule_key="r", severity="MAJOR",
                telemetry_event_id=f"{n:064x}", reason="test", node_id="n1", now=now,
            )  # fmt: skip
    statement = alarm_repo.MARK_UNREACHED.rstrip().rstrip(";")
    await db.execute(f"PREPARE unreached(timestamptz, timestamptz, int) AS {statement}")
    try:
        for fired_before, marked in ((now - timedelta(hours=1), 0), (now, 100)):
            attempt = db.transaction()
            await attempt.start()
            try:
                (explained,) = json.loads(
                    await db.fetchval(
                        "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE unreached("
                        f"'{fired_before.isoformat()}', '{now.isoformat()}', 100)"
                    )
                )
                marked_now = await db.fetchval(
                    "SELECT count(*) FROM alarm WHERE unreached_at IS NOT NULL"
                )
            finally:
                await attempt.rollback()
            assert marked_now == marked
            repeated = [
                (node["Node Type"], node.get("Relation Name"), node["Actual Loops"])
                for node in plan_nodes(explained["Plan"])
                if node["Actual Loops"] > 1
            ]
            assert not repeated, repeated
    finally:
        await db.execute("DEALLOCATE unreached")
