"""Rule state in PostgreSQL: two writers on the same (device, rule), with the commit order forced.

Each "node" is an `AlarmEngine` with its own connection; a batch is one transaction. The
order in which their batches commit is chosen by the test, never left to the scheduler.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
import pytest

from gateway.alarms.engine import HELD_SKIP_MAX, AlarmEngine, BatchAlarms
from gateway.alarms.lifecycle import clear_alarm, create_alarm
from gateway.domain.errors import ConcurrentWriteError
from gateway.domain.rules import RuleConfig, RuleState, compile_rules, rule_version
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id
from storage import rule_state as state_repo
from storage.pool import create_pool
from tests.support.waiting import wait_until

T0 = 1_767_225_600_000
DOOR = RuleConfig(key="door-open", kind="event", event="DOOR_OPEN", severity="MAJOR")
HOT = RuleConfig(
    key="temp-high", kind="threshold", metric="temp", op=">", value=80, clear_value=75,
    severity="CRITICAL",
)  # fmt: skip
RULES = compile_rules([DOOR, HOT])


def _temp(second: int, value: float) -> Telemetry:
    return Telemetry(ts=T0 + second * 1000, metrics={"temp": value})


def _event(second: int, event_type: str) -> Telemetry:
    return Telemetry(ts=T0 + second * 1000, events=[{"type": event_type}])


def _rows(device: str, *messages: Telemetry) -> list[tuple[str, str, Telemetry]]:
    return [(device, telemetry_event_id(device, m), m) for m in messages]


@pytest.fixture
async def nodes(db_dsn: str) -> AsyncIterator[list[tuple[AlarmEngine, asyncpg.Connection]]]:
    conns = [await asyncpg.connect(db_dsn) for _ in range(2)]
    engines = [AlarmEngine(rules=RULES, node_id=f"node-{n}", metrics=Metrics()) for n in "ab"]
    try:
        yield list(zip(engines, conns, strict=True))
    finally:
        for conn in conns:
            await conn.close()


async def _commit(
    node: tuple[AlarmEngine, asyncpg.Connection], rows: list[tuple[str, str, Telemetry]]
) -> BatchAlarms:
    engine, conn = node
    async with conn.transaction():
        batch = await engine.on_stored(conn, rows)
    engine.committed(batch)
    return batch


async def _alarms(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(
        await db.fetch(
            "SELECT id, device_id, rule_key, status, telemetry_event_id, cleared_at, "
            "clear_event_id, superseded_by, active_key, triggered_at, superseded_at "
            "FROM alarm ORDER BY id"
        )
    )


# A write-back of rows judged as held (write_states with the tokens to check), as logged.
HELD_WRITE = "write_states, rows held"


def _statement(logged: asyncpg.connection.LoggedQuery) -> str:
    """The logged statement's text, or HELD_WRITE for a write-back of rows judged as held."""
    if logged.query == state_repo.WRITE_STATES and logged.args[5]:
        return HELD_WRITE
    return str(logged.query)


async def test_a_batch_waits_for_the_other_nodes_batch_on_the_same_pair_and_sees_its_state(
    nodes: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    """Node A's batch (95) holds the row; node B's (96, then 70) waits for its commit, then
    decides from what A wrote: no second alarm for 96, and 70 clears A's alarm."""
    (engine_a, conn_a), node_b = nodes
    b_pid = await node_b[1].fetchval("SELECT pg_backend_pid()")
    transaction = conn_a.transaction()
    await transaction.start()
    a_batch = await engine_a.on_stored(conn_a, _rows("dev", _temp(1, 95)))
    b_task = asyncio.create_task(_commit(node_b, _rows("dev", _temp(2, 96), _temp(3, 70))))

    async def b_waits_on_a_lock() -> bool:
        kind = await db.fetchval("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                                 b_pid)  # fmt: skip
        return kind == "Lock"

    await wait_until(b_waits_on_a_lock, timeout=30, message="node B blocked on the row lock")
    assert not b_task.done()
    await transaction.commit()
    engine_a.committed(a_batch)
    b_batch = await b_task

    assert len(a_batch.created) == 1
    assert (b_batch.created, b_batch.cleared) == ([], 1)
    (alarm,) = await _alarms(db)
    assert alarm["cleared_at"] is not None
    state = await state_repo.get_state(db, "dev", "temp-high")
    assert state is not None
    assert (state["firing"], state["version"], state["node_id"]) == (False, 2, "node-b")


async def test_a_later_sample_committed_first_is_not_undone_by_the_older_one(
    nodes: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    node_a, node_b = nodes
    await _commit(node_a, _rows("dev", _temp(8, 95)))  # fired
    await _commit(node_b, _rows("dev", _temp(11, 70)))  # B commits sample 11 first: cleared
    late = await _commit(node_a, _rows("dev", _temp(10, 95)))  # A's sample 10, late
    assert (late.created, late.cleared) == ([], 0)
    (alarm,) = await _alarms(db)
    assert alarm["cleared_at"] is not None
    state = await state_repo.get_state(db, "dev", "temp-high")
    assert state is not None
    assert not state["firing"]
    assert state["last_ts"].timestamp() * 1000 == T0 + 11_000


async def test_an_open_committed_after_its_close_is_an_alarm_already_cleared(
    nodes: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    node_a, node_b = nodes
    (close_row,) = _rows("door", _event(11, "DOOR_CLOSE"))
    closed = await _commit(node_b, [close_row])
    assert closed.cleared == 0  # nothing open yet
    opened = await _commit(node_a, _rows("door", _event(10, "DOOR_OPEN")))
    assert (len(opened.created), opened.cleared) == (1, 1)
    (alarm,) = await _alarms(db)
    assert alarm["clear_event_id"] == close_row[1]
    assert alarm["status"] == "NEW"  # still to be pushed and handled by people
    events = await db.fetch("SELECT event_type FROM outbox_event ORDER BY id")
    assert [e["event_type"] for e in events] == ["alarm.created", "alarm.cleared"]
    state = await state_repo.get_state(db, "door", "door-open")
    assert state is not None
    assert not state["firing"]


async def test_an_open_committed_after_a_newer_open_is_created_superseded_by_it(
    nodes: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    node_a, node_b = nodes
    (newer,) = _rows("door", _event(12, "DOOR_OPEN"))
    await _commit(node_b, [newer])
    late = await _commit(node_a, _rows("door", _event(10, "DOOR_OPEN")))
    assert (len(late.created), late.late, late.superseded) == (1, 1, 0)
    current, old = await _alarms(db)
    assert (current["status"], current["active_key"]) == ("NEW", "door:door-open")
    assert current["telemetry_event_id"] == newer[1]
    assert (old["status"], old["active_key"], old["superseded_by"]) == (
        "SUPERSEDED", None, current["id"],
    )  # fmt: skip
    assert old["cleared_at"] is None
    audit = await db.fetchrow("SELECT action, from_status, to_status, note FROM alarm_audit "
                              "WHERE alarm_id = $1", old["id"])  # fmt: skip
    assert audit is not None
    assert (audit["action"], audit["from_status"], audit["to_status"]) == (
        "create", None, "SUPERSEDED",
    )  # fmt: skip
    # The chain of the open alarm shows both, oldest first in device order.
    chain = await db.fetch("SELECT id FROM alarm WHERE superseded_by = $1", current["id"])
    assert [r["id"] for r in chain] == [old["id"]]
    # Redelivered: nothing more.
    again = await _commit(node_b, _rows("door", _event(10, "DOOR_OPEN")))
    assert (again.created, again.deduplicated) == ([], 1)


async def test_concurrent_batches_over_the_same_pairs_in_opposite_orders_never_deadlock(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Six writers released together, each with the same 40 devices in its own order: the
    rows are locked in one sorted order, so no deadlock is ever detected; one alarm each."""
    devices = [f"dev-{n:02d}" for n in range(40)]
    writers = 6
    conns = [await asyncpg.connect(db_dsn) for _ in range(writers)]
    engines = [AlarmEngine(rules=RULES, node_id=f"n{i}", metrics=Metrics()) for i in range(writers)]
    start = asyncio.Barrier(writers)

    async def write(index: int) -> BatchAlarms:
        order = devices if index % 2 else list(reversed(devices))
        rows = [r for d in order for r in _rows(d, _temp(index, 90 + index))]
        await start.wait()
        return await _commit((engines[index], conns[index]), rows)

    try:
        batches = await asyncio.gather(*(write(i) for i in range(writers)))
    finally:
        for conn in conns:
            await conn.close()
    assert sum(len(b.created) for b in batches) == len(devices)
    assert await db.fetchval("SELECT count(*) FROM alarm") == len(devices)
    assert await db.fetchval("SELECT count(*) FROM rule_state WHERE firing") == len(devices)


async def test_restart_changes_no_decision_and_removed_rules_lose_their_state(
    nodes: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection, db_dsn: str
) -> None:
    node_a, _ = nodes
    slow = RuleConfig(key="slow", kind="threshold", metric="temp", op=">", value=80,
                      for_samples=3, severity="MAJOR")  # fmt: skip
    engine = AlarmEngine(rules=compile_rules([DOOR, slow]), node_id="a", metrics=Metrics())
    await _commit((engine, node_a[1]), _rows("dev", _temp(1, 90), _temp(2, 90)))
    await _commit((engine, node_a[1]), _rows("dev", _event(3, "DOOR_OPEN")))
    # A new process (nothing carried over) counts on from the database: the third sample fires.
    restarted = AlarmEngine(rules=compile_rules([DOOR, slow]), node_id="b", metrics=Metrics())
    fired = await _commit((restarted, node_a[1]), _rows("dev", _temp(4, 90)))
    assert [key for key, _ in fired.created] == ["slow"]

    # A changed definition keeps the facts (firing) and drops pending counts.
    await _commit((restarted, node_a[1]), _rows("other", _temp(1, 90), _temp(2, 90)))
    changed = RuleConfig(key="slow", kind="threshold", metric="temp", op=">", value=85,
                         for_samples=3, severity="MAJOR")  # fmt: skip
    reloaded = AlarmEngine(rules=compile_rules([DOOR, changed]), node_id="c", metrics=Metrics())
    nothing = await _commit((reloaded, node_a[1]), _rows("other", _temp(3, 90)))
    assert nothing.created == []  # 1 of 3 under the new definition, not 3 of 3
    pending = await state_repo.get_state(db, "other", "slow")
    assert pending is not None
    assert pending["pending_count"] == 1
    (new_slow,) = [r for r in reloaded.rules if r.key == "slow"]
    assert pending["rule_version"] == rule_version(new_slow)
    still = await _commit((reloaded, node_a[1]), _rows("dev", _temp(5, 70)))
    assert still.cleared == 1  # it was firing under the old definition, and clears

    # A reload that removes the door rule drops its state, and only its.
    reloaded.replace_rules(compile_rules([changed]))
    stop = asyncio.Event()
    pool = await create_pool(db_dsn, min_size=1, max_size=1)
    try:
        janitor = asyncio.create_task(reloaded.forget_loop(pool, stop))

        async def door_state_gone() -> bool:
            gone = "SELECT count(*) FROM rule_state WHERE rule_key = 'door-open'"
            return await db.fetchval(gone) == 0

        await wait_until(door_state_gone, timeout=30, message="door-open state dropped")
        stop.set()
        await janitor
    finally:
        await pool.close()
    assert await db.fetchval("SELECT count(*) FROM rule_state WHERE rule_key = 'slow'") == 2


async def test_supersede_and_clear_times_never_precede_the_trigger_of_another_node(
    db: asyncpg.Connection,
) -> None:
    """Node B's transaction started before node A's, yet acts on A's alarm after it: the
    times it stamps are never earlier than A's trigger (the table's CHECK would refuse)."""
    later = await db.fetchval("SELECT now()")
    earlier = later - timedelta(seconds=5)
    async with db.transaction():
        first = await create_alarm(
            db, device_id="dev", rule_key="door-open", severity="MAJOR",
            telemetry_event_id="a" * 64, reason="DOOR_OPEN", node_id="node-a", now=later,
        )  # fmt: skip
    async with db.transaction():
        second = await create_alarm(
            db, device_id="dev", rule_key="door-open", severity="MAJOR",
            telemetry_event_id="b" * 64, reason="DOOR_OPEN", node_id="node-b", now=earlier,
        )  # fmt: skip
    assert first.alarm is not None
    assert second.superseded_id == first.alarm.id
    old = await db.fetchrow("SELECT triggered_at, superseded_at FROM alarm WHERE id = $1",
                            first.alarm.id)  # fmt: skip
    assert old is not None
    assert old["superseded_at"] == old["triggered_at"] == later
    async with db.transaction():
        third = await create_alarm(
            db, device_id="dev2", rule_key="door-open", severity="MAJOR",
            telemetry_event_id="c" * 64, reason="DOOR_OPEN", node_id="node-a", now=later,
        )  # fmt: skip
        cleared = await clear_alarm(
            db, device_id="dev2", rule_key="door-open", clear_event_id="d" * 64,
            reason="DOOR_CLOSE", now=earlier,
        )  # fmt: skip
    assert third.alarm is not None
    assert cleared == third.alarm.id
    assert await db.fetchval("SELECT cleared_at FROM alarm WHERE id = $1", cleared) == later


async def test_a_concurrent_alarm_on_the_same_active_key_asks_for_a_retry_not_a_crash(
    nodes: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    """Node A's new alarm is inserted but not committed; node B raises one for the same
    device and rule from another event: B waits on A's row, then must be told to retry (the
    active key's unique index, not the dedup key's ON CONFLICT, catches it) — and its retry
    supersedes A's alarm."""
    (_, conn_a), (_, conn_b) = nodes
    now = await db.fetchval("SELECT now()")
    b_pid = await conn_b.fetchval("SELECT pg_backend_pid()")

    async def raise_on(conn: asyncpg.Connection, event: str) -> int | None:
        async with conn.transaction():
            creation = await create_alarm(
                conn, device_id="dev", rule_key="silent", severity="WARNING",
                telemetry_event_id=event * 64, reason="silent", node_id="n", now=now,
            )  # fmt: skip
        return None if creation.alarm is None else creation.alarm.id

    transaction = conn_a.transaction()
    await transaction.start()
    first = await create_alarm(
        conn_a, device_id="dev", rule_key="silent", severity="WARNING",
        telemetry_event_id="a" * 64, reason="silent", node_id="n", now=now,
    )  # fmt: skip
    b_task = asyncio.create_task(raise_on(conn_b, "b"))

    async def b_waits_on_a_lock() -> bool:
        kind = await db.fetchval("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                                 b_pid)  # fmt: skip
        return kind == "Lock"

    await wait_until(b_waits_on_a_lock, timeout=30, message="node B blocked on A's insert")
    await transaction.commit()
    with pytest.raises(ConcurrentWriteError):
        await b_task
    assert first.alarm is not None
    retried = await raise_on(conn_b, "b")
    assert retried is not None
    superseded = await db.fetchval("SELECT superseded_by FROM alarm WHERE id = $1",
                                   first.alarm.id)  # fmt: skip
    assert superseded == retried


def test_a_stored_row_carries_the_domain_state_in_the_same_field_order() -> None:
    """The engine converts rows and states positionally (per touched pair, per batch)."""
    domain = list(RuleState.__struct_fields__)
    stored = list(state_repo.RuleStateRow.__struct_fields__)
    assert stored == ["device_id", "rule_key", "version", "rule_version", *domain]


async def test_a_write_back_is_conditional_on_the_version_each_row_was_read_at(
    db: asyncpg.Connection,
) -> None:
    """Rows travel as one array of `rule_state_write` records; each is written only if its
    row still has the version it was read at, and a write of fewer rows than sent raises (the
    caller's transaction then rolls back and the batch is evaluated again)."""
    version = rule_version(RULES.by_key("temp-high"))  # type: ignore[arg-type]
    keys = [(f"dev-{n}", "temp-high", version) for n in range(3)]
    async with db.transaction():
        read = [entry.row for entry in await state_repo.lock_states(db, keys)]
    assert [row.version for row in read] == [0, 0, 0]
    moved = [msgspec.structs.replace(row, last_seq=7, firing=True) for row in read]
    async with db.transaction():
        await state_repo.write_states(db, moved, "node-a")
    rows = await db.fetch(
        "SELECT device_id, version, last_seq, firing, node_id FROM rule_state ORDER BY device_id"
    )
    assert [tuple(r) for r in rows] == [(f"dev-{n}", 1, 7, True, "node-a") for n in range(3)]

    stale = [msgspec.structs.replace(row, last_seq=8) for row in read]  # still version 0
    fresh = msgspec.structs.replace(moved[0], version=1, last_seq=9)
    with pytest.raises(state_repo.StateWriteConflictError, match="2 of 3 rule states changed"):
        async with db.transaction():
            await state_repo.write_states(db, [fresh, *stale[1:]], "node-b")
    assert await db.fetchval("SELECT max(last_seq) FROM rule_state") == 7  # rolled back


_AT = datetime(2026, 12, 5, 3, 0, 0, 123457, tzinfo=UTC)


@pytest.mark.parametrize(
    "moves",
    [
        # a clearing sample: the newest sample and the newest clearing one
        {"last_ts": _AT, "last_seq": 5, "clear_ts": _AT, "clear_event_id": "c" * 64},
        # a violating one, no seq
        {"last_ts": _AT, "last_seq": None, "violating_ts": _AT - timedelta(microseconds=1)},
        # every moved column NULL again (a state brought back from a clock ahead)
        {
            "last_ts": None,
            "last_seq": None,
            "clear_ts": None,
            "clear_event_id": None,
            "last_device_ts": None,
        },
        # a sample judged at its receipt: its own time beside it (a clock reset to 1970)
        {
            "last_ts": _AT,
            "last_seq": 0,
            "last_device_ts": datetime(1970, 1, 1, 0, 0, 5, tzinfo=UTC),
        },
    ],
)
@pytest.mark.parametrize("count", [1, 3])
async def test_rows_a_sample_moved_are_written_in_those_columns_only_beside_whole_rows(
    db: asyncpg.Connection, moves: dict[str, object], count: int
) -> None:
    """write_states' ``moved`` rows (changed in SAMPLE_MOVES only) travel as columns of lines
    and set those columns alone; rows written whole beside them in the same statement set
    every column. Each row comes back exactly as sent, its version one on, and a token the
    next lock_states answers as held."""
    version = rule_version(RULES.by_key("temp-high"))  # type: ignore[arg-type]
    keys = [(f"dev-{n}", "temp-high", version) for n in range(count + 1)]
    async with db.transaction():
        read = [e.row for e in await state_repo.lock_states(db, keys)]
    # Start from rows with every column set, so that a column the moved write left alone
    # (or wrote by mistake) shows.
    full = {
        "pending_count": 2, "pending_since": _AT - timedelta(seconds=9), "fired_ts": _AT,
        "fired_event_id": "f" * 64, "released_ts": _AT - timedelta(seconds=1),
        "clear_ts": _AT - timedelta(seconds=3), "clear_event_id": "0" * 64,
        "violating_ts": _AT - timedelta(seconds=2), "last_ts": _AT - timedelta(seconds=4),
        "last_seq": 4, "last_device_ts": _AT + timedelta(hours=8),
    }  # fmt: skip
    async with db.transaction():
        await state_repo.write_states(db, [msgspec.structs.replace(r, **full) for r in read], "a")
    async with db.transaction():
        read = [e.row for e in await state_repo.lock_states(db, keys)]
    assert {r.version for r in read} == {1}
    whole = msgspec.structs.replace(read[0], firing=True, pending_count=0, pending_since=None)
    moved = [msgspec.structs.replace(r, **moves) for r in read[1:]]
    async with db.transaction():
        xmin = await state_repo.write_states(db, [whole], "b", moved)
    async with db.transaction():
        again = await state_repo.lock_states(db, keys)
    assert [e.row for e in again] == [
        msgspec.structs.replace(r, version=2) for r in [whole, *moved]
    ]
    assert {e.token for e in again} == {f"2.{xmin}"}
    assert await db.fetchval("SELECT count(*) FROM rule_state WHERE node_id = 'b'") == count + 1


@pytest.mark.parametrize("column", state_repo.SAMPLE_MOVES)
async def test_each_column_a_sample_moves_is_written_by_the_moved_write(
    db: asyncpg.Connection, column: str
) -> None:
    """Every column SAMPLE_MOVES names (the engine sends a row as moved when it changed in
    no other) is one the moved write sends and sets: a name added there and not to the
    statement fails here, not in the field as a change silently dropped."""
    version = rule_version(RULES.by_key("temp-high"))  # type: ignore[arg-type]
    async with db.transaction():
        (read,) = [e.row for e in await state_repo.lock_states(db, [("d", "temp-high", version)])]
    value = {"last_seq": 3, "clear_event_id": "c" * 64}.get(column, _AT)
    changed = msgspec.structs.replace(read, **{column: value})
    if column.startswith("clear_"):  # the table keeps the clear's time and id in pairs
        changed = msgspec.structs.replace(changed, clear_ts=_AT, clear_event_id="c" * 64)
    async with db.transaction():
        await state_repo.write_states(db, [], "a", [changed])
    stored = await state_repo.get_state(db, "d", "temp-high")
    assert stored is not None
    assert stored[column] == value
    assert stored["version"] == 1


async def test_a_moved_row_read_at_an_older_version_fails_the_write_and_writes_nothing(
    db: asyncpg.Connection,
) -> None:
    """A moved row is as conditional on the version read as a whole one: one written by
    someone since counts among the rows not written, and the caller's transaction rolls back;
    a held write whose held rows are not all still held writes no moved row either."""
    version = rule_version(RULES.by_key("temp-high"))  # type: ignore[arg-type]
    keys = [(f"dev-{n}", "temp-high", version) for n in range(3)]
    async with db.transaction():
        read = [e.row for e in await state_repo.lock_states(db, keys)]
        xmin = await state_repo.write_states(db, read, "a")  # now version 1
    stale = [msgspec.structs.replace(r, last_seq=8) for r in read]  # read at version 0
    fresh = [msgspec.structs.replace(r, version=1, last_seq=9) for r in read]
    with pytest.raises(state_repo.StateWriteConflictError, match="1 of 3 rule states changed"):
        async with db.transaction():
            await state_repo.write_states(db, [fresh[0]], "b", [fresh[1], stale[2]])
    with pytest.raises(state_repo.StateWriteConflictError, match="2 of 2 rule states changed"):
        async with db.transaction():
            await state_repo.write_states(db, [], "b", stale[:2])
    assert await db.fetchval("SELECT count(*) FROM rule_state WHERE last_seq IS NOT NULL") == 0
    xid, _, started = xmin.partition("@")
    held = [(r.device_id, r.rule_key, f"1.{xid}@{started}") for r in read]
    gone = [*held[:2], (read[2].device_id, read[2].rule_key, f"1.{xid}@{int(started) - 1}")]
    async with db.transaction():
        assert await state_repo.write_held_states(db, gone, [], "b", fresh) is None
    assert await db.fetchval("SELECT count(*) FROM rule_state WHERE last_seq IS NOT NULL") == 0
    async with db.transaction():
        assert await state_repo.write_held_states(db, held, [], "b", fresh) is not None
    assert await db.fetchval("SELECT count(*) FROM rule_state WHERE last_seq = 9") == 3


async def test_the_engine_writes_a_sample_that_moved_the_state_only_as_moved(
    db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the engine sends, on both write paths (rows locked and read, rows held): a
    sample that changes no more than the newest times (a clearing sample of a quiet device)
    goes as a moved row; one that fires or clears an alarm goes whole. Either way the row
    stored is the state judged."""
    engine = AlarmEngine(rules=RULES, node_id="a", metrics=Metrics())
    sent: list[tuple[str, int, int]] = []
    write, write_held = state_repo.write_states, state_repo.write_held_states

    async def spy(conn: asyncpg.Connection, rows: Any, node_id: str, moved: Any = ()) -> str:
        sent.append(("locked", len(rows), len(moved)))
        return await write(conn, rows, node_id, moved)

    async def spy_held(
        conn: asyncpg.Connection, held: Any, rows: Any, node_id: str, moved: Any = ()
    ) -> str | None:
        sent.append(("held", len(rows), len(moved)))
        return await write_held(conn, held, rows, node_id, moved)

    monkeypatch.setattr(state_repo, "write_states", spy)
    monkeypatch.setattr(state_repo, "write_held_states", spy_held)
    for second, temp in [(1, 70.0), (2, 71.0), (3, 90.0), (4, 60.0), (5, 61.0)]:
        async with db.transaction():
            batch = await engine.on_stored(db, _rows("dev-1", _temp(second, temp)))
        engine.committed(batch)
    # 70 and 71 clear again (moved); 90 fires, 60 clears the alarm (whole); 61 moved again.
    # The first batch holds nothing and locks its row; the others judge the row held.
    assert sent == [
        ("locked", 0, 1), ("held", 0, 1), ("held", 1, 0), ("held", 1, 0), ("held", 0, 1)
    ]  # fmt: skip
    stored = await state_repo.get_state(db, "dev-1", "temp-high")
    assert stored is not None
    judged = engine._held["dev-1", "temp-high"]
    fields = state_repo.RuleStateRow.__struct_fields__
    assert state_repo.RuleStateRow(*(stored[f] for f in fields)) == judged.row
    assert (stored["version"], stored["firing"], stored["last_ts"]) == (
        5, False, datetime.fromtimestamp((T0 + 5000) / 1000, UTC)
    )  # fmt: skip


@pytest.mark.parametrize(
    "at",
    [
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(2026, 12, 3, 18, 30, 1, 123457, tzinfo=UTC),
        datetime(2112, 1, 1, 0, 0, 0, 999999, tzinfo=UTC),
        datetime(9998, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ],
)
async def test_times_written_back_come_back_to_the_microsecond(
    db: asyncpg.Connection, at: datetime
) -> None:
    """The write-back sends its times as microseconds (rule_state_write_us2) and the query turns
    them back: every time column, over the whole range a device time may take (a float8 of
    microseconds would be off from the 2110s on), and a time before 1970."""
    version = rule_version(RULES.by_key("temp-high"))  # type: ignore[arg-type]
    async with db.transaction():
        (locked,) = await state_repo.lock_states(db, [("dev", "temp-high", version)])
    # Each column its own time (a column written into another's fails too).
    times = {name: at - timedelta(microseconds=i) for i, name in enumerate(_TIME_FIELDS)}
    row = msgspec.structs.replace(
        locked.row, **times, last_seq=1, fired_event_id="e1", clear_event_id="e2", pending_count=1
    )
    async with db.transaction():
        await state_repo.write_states(db, [row], "node-a")
    stored = await state_repo.get_state(db, "dev", "temp-high")
    assert stored is not None
    assert {name: stored[name] for name in _TIME_FIELDS} == times


async def test_the_write_backs_time_conversion_is_inlined_not_called_per_row(
    db: asyncpg.Connection,
) -> None:
    """from_micros (migration 0034) is one SQL expression the planner inlines: declared
    IMMUTABLE or STRICT it would stay a function call per time per row (in the rows written
    whole and in the moved ones)."""
    values = {1: "'{}'::rule_state_write_us2[]", 2: "'n'", 6: "0"}  # every other one ''
    statement = re.sub(r"\$(\d+)\b", lambda m: values.get(int(m[1]), "''"), state_repo.WRITE_STATES)
    async with db.transaction():
        plan = "\n".join(r[0] for r in await db.fetch(f"EXPLAIN VERBOSE {statement}"))
    assert "to_timestamp" in plan
    assert "from_micros(" not in plan


_TIME_FIELDS = [
    name
    for name, kind in zip(
        state_repo.RuleStateRow.__struct_fields__,
        msgspec.structs.fields(state_repo.RuleStateRow),
        strict=True,
    )
    if "datetime" in str(kind.type)
]


def test_every_time_field_of_a_row_is_written_as_microseconds() -> None:
    """The write-back's record spells each time field out: a new one must be added there."""
    assert _TIME_FIELDS == [
        "pending_since", "last_ts", "fired_ts", "released_ts", "clear_ts", "violating_ts",
        "last_device_ts",
    ]  # fmt: skip


async def test_rows_a_node_has_seen_are_locked_without_an_insert_and_a_vanished_one_comes_back(
    nodes: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    """A device's first batch creates its rows then locks them; later batches are judged
    from the rows the node holds, locked and written in one statement (no create, no lock
    first). A row gone meanwhile (a rule's state dropped) is created again and the batch
    decides as on a first sample."""
    conn = nodes[0][1]
    queries: list[str] = []
    conn.add_query_logger(lambda logged: queries.append(_statement(logged)))

    def creates() -> int:
        return sum(q == state_repo.CREATE_STATES for q in queries)

    await _commit(nodes[0], _rows("dev", _temp(1, 70), _event(1, "DOOR_OPEN")))
    assert creates() == 1
    await _commit(nodes[0], _rows("dev", _temp(2, 71)))
    await _commit(nodes[0], _rows("dev", _temp(3, 72), _event(3, "DOOR_OPEN")))
    assert creates() == 1
    assert sum(q == state_repo.LOCK_STATES for q in queries) == 1
    assert sum(q == state_repo.WRITE_STATES for q in queries) == 1
    assert sum(q == HELD_WRITE for q in queries) == 2
    await _commit(nodes[0], _rows("other", _temp(3, 72)))  # a new device: created
    assert creates() == 2

    await db.execute("DELETE FROM rule_state WHERE device_id = 'dev' AND rule_key = 'temp-high'")
    batch = await _commit(nodes[0], _rows("dev", _temp(4, 95)))
    assert creates() == 3
    assert len(batch.created) == 1
    state = await state_repo.get_state(db, "dev", "temp-high")
    assert state is not None
    assert (state["firing"], state["version"]) == (True, 1)
    # The other node has seen none of these rows: it creates, and decides alike.
    other = await _commit(nodes[1], _rows("dev", _temp(5, 96)))
    assert (other.created, other.cleared) == ([], 0)
    assert (await state_repo.get_state(db, "dev", "temp-high"))["version"] == 2  # type: ignore[index]


async def test_a_held_row_is_answered_as_held_only_while_nobody_wrote_it_since(
    db: asyncpg.Connection, db_dsn: str
) -> None:
    """lock_states answers a row the caller holds (its token: version and xmin) without its
    columns, and reads whole every row written since: by another writer, or deleted and
    written again up to the same version (the xmin tells that write from the one held)."""
    version = rule_version(RULES.by_key("temp-high"))  # type: ignore[arg-type]
    keys = [(f"dev-{n}", "temp-high", version) for n in range(3)]
    async with db.transaction():
        locked = await state_repo.lock_states(db, keys)
        moved = [msgspec.structs.replace(e.row, last_seq=1, firing=True) for e in locked]
        xmin = await state_repo.write_states(db, moved, "node-a")
    held = {
        (row.device_id, row.rule_key): state_repo.LockedRow(
            f"{row.version + 1}.{xmin}",
            msgspec.structs.replace(row, version=row.version + 1),
        )
        for row in moved
    }
    answers: list[list[bool]] = []

    async def lock() -> list[state_repo.LockedRow]:
        queries: list[asyncpg.connection.LoggedQuery] = []
        db.add_query_logger(queries.append)
        try:
            async with db.transaction():
                locked = await state_repo.lock_states(db, keys, exist=True, held=held)
        finally:
            db.remove_query_logger(queries.append)
        (query,) = (q for q in queries if q.query == state_repo.LOCK_STATES)
        # What the server answered: whether each row came as held (its columns not sent).
        answers.append(
            [r["hit"] for r in await db.fetch(query.query, *query.args)]  # same tokens again
        )
        return locked

    first = await lock()
    assert answers[-1] == [True, True, True]
    # Each held row is answered with the very copy held.
    assert all(got is held[k[0], k[1]] for got, k in zip(first, keys, strict=True))

    # Another writer moves dev-1; dev-2 is deleted and written again to the same version.
    other = await asyncpg.connect(db_dsn)
    try:
        async with other.transaction():
            (locked1,) = await state_repo.lock_states(other, keys[1:2])
            row1 = locked1.row
            await state_repo.write_states(
                other, [msgspec.structs.replace(row1, last_seq=2, firing=False)], "node-b"
            )
        await other.execute("DELETE FROM rule_state WHERE device_id = 'dev-2'")
        async with other.transaction():
            (locked2,) = await state_repo.lock_states(other, keys[2:])
            fresh = locked2.row
            assert fresh.version == 0
            await state_repo.write_states(
                other, [msgspec.structs.replace(fresh, last_seq=3, firing=False)], "node-b"
            )
    finally:
        await other.close()

    second = await lock()
    assert answers[-1] == [True, False, False]
    rows = {entry.row.device_id: entry.row for entry in second}
    assert rows["dev-0"] == held["dev-0", "temp-high"].row
    assert (rows["dev-1"].last_seq, rows["dev-1"].firing, rows["dev-1"].version) == (2, False, 2)
    # Same version as held (1), another write: read whole, with its own token.
    assert (rows["dev-2"].last_seq, rows["dev-2"].firing, rows["dev-2"].version) == (3, False, 1)
    tokens = {entry.row.device_id: entry.token for entry in second}
    assert tokens["dev-2"] != held["dev-2", "temp-high"].token
    assert tokens["dev-2"].startswith("1.")


async def test_a_node_holding_its_rows_still_decides_on_what_another_node_wrote(
    nodes: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    """Node A holds the row it wrote; node B clears the alarm on the same device; A's next
    violation must raise a new alarm (a stale held state would say "still firing"). A batch
    rolled back leaves nothing held."""
    a, b = nodes
    assert len((await _commit(a, _rows("dev", _temp(1, 90)))).created) == 1
    assert (await _commit(b, _rows("dev", _temp(2, 70)))).cleared == 1
    assert len((await _commit(a, _rows("dev", _temp(3, 91)))).created) == 1
    assert (await _commit(b, _rows("dev", _temp(4, 70)))).cleared == 1

    # A batch of A's that rolls back: its rows are not held (committed() is never called).
    engine, conn = a
    transaction = conn.transaction()
    await transaction.start()
    rolled_back = await engine.on_stored(conn, _rows("dev", _temp(5, 95)))
    await transaction.rollback()
    assert rolled_back.held  # what it would have held, had it committed
    assert len((await _commit(b, _rows("dev", _temp(6, 92)))).created) == 1
    # A's view: firing since B's sample of second 6; a clear from A closes B's alarm.
    assert (await _commit(a, _rows("dev", _temp(7, 60)))).cleared == 1
    alarms = await _alarms(db)
    assert len(alarms) == 3  # the rolled-back batch's alarm is gone with it
    assert all(r["cleared_at"] is not None for r in alarms)


async def test_a_held_row_from_another_run_of_the_server_is_read_whole(
    db: asyncpg.Connection,
) -> None:
    """Transaction ids lost with a timeline (an asynchronous standby promoted, a point-in-time
    restore) are issued again, so a token names the server's run too: the same version and
    xmin held from another run is read whole."""
    version = rule_version(RULES.by_key("temp-high"))  # type: ignore[arg-type]
    keys = [("dev-0", "temp-high", version)]
    async with db.transaction():
        (locked,) = await state_repo.lock_states(db, keys)
        row = locked.row
        xmin = await state_repo.write_states(db, [msgspec.structs.replace(row, last_seq=1)], "a")
    started = await db.fetchval(
        "SELECT (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint::text"
    )
    xid, _, tag = xmin.partition("@")
    assert tag == started
    written = msgspec.structs.replace(row, last_seq=1, version=1)
    for token, hit in ((f"1.{xid}@{started}", True), (f"1.{xid}@{int(started) - 1}", False)):
        # The copy held says last_seq 7: only a hit may answer with it.
        copy = msgspec.structs.replace(written, last_seq=7)
        async with db.transaction():
            (got,) = await state_repo.lock_states(
                db,
                keys,
                exist=True,
                held={("dev-0", "temp-high"): state_repo.LockedRow(token, copy)},
            )
        assert got.row.last_seq == (7 if hit else 1), token
        assert got.token == f"1.{xid}@{started}"


async def test_a_held_batch_that_waits_for_another_nodes_write_is_judged_again_under_lock(
    nodes: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    """Node A holds the row it wrote (firing since 95) and judges its next batch (96) from
    it, with no lock first. Node B clears the alarm (70) in a transaction still open when
    A's statement comes: A waits for B's row, finds it written by B, writes nothing of what
    it judged, and judges the batch again from B's row: 96 raises a new alarm (the held
    state said "still firing"). A then locks first for its next batch, and after a batch in
    which nobody wrote its rows judges from what it holds again."""
    (engine_a, conn_a), (engine_b, conn_b) = nodes
    queries: list[str] = []
    conn_a.add_query_logger(lambda logged: queries.append(_statement(logged)))
    a_pid = await conn_a.fetchval("SELECT pg_backend_pid()")
    assert len((await _commit(nodes[0], _rows("dev", _temp(1, 95)))).created) == 1

    transaction = conn_b.transaction()
    await transaction.start()
    b_batch = await engine_b.on_stored(conn_b, _rows("dev", _temp(2, 70)))
    assert b_batch.cleared == 1
    del queries[:]
    a_task = asyncio.create_task(_commit(nodes[0], _rows("dev", _temp(3, 96))))

    async def a_waits_on_b() -> bool:
        kind = await db.fetchval("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                                 a_pid)  # fmt: skip
        return kind == "Lock"

    await wait_until(a_waits_on_b, timeout=30, message="node A blocked on B's row")
    # Judged as held, waiting to lock and write it: no lock taken before.
    waiting = await db.fetchval("SELECT query FROM pg_stat_activity WHERE pid = $1", a_pid)
    assert state_repo.WRITE_STATES.startswith(waiting[:900])  # the view cuts it at 1 KB
    assert state_repo.LOCK_STATES not in queries
    await transaction.commit()
    engine_b.committed(b_batch)
    a_batch = await a_task

    assert len(a_batch.created) == 1
    held_at = queries.index(HELD_WRITE)
    assert queries[held_at + 1] == state_repo.LOCK_STATES  # then judged again under lock
    metric = engine_a.alarm_metrics.held_batches
    assert (metric.labels("written")._value.get(), metric.labels("contended")._value.get()) == (
        0,
        1,
    )
    alarms = await _alarms(db)
    assert [a["cleared_at"] is not None for a in alarms] == [True, False]
    state = await state_repo.get_state(db, "dev", "temp-high")
    assert state is not None
    assert (state["firing"], state["version"], state["node_id"]) == (True, 3, "node-a")

    # Contended once: the next batch locks first; the one after judges from held rows again.
    del queries[:]
    await _commit(nodes[0], _rows("dev", _temp(4, 97)))
    assert state_repo.LOCK_STATES in queries
    assert HELD_WRITE not in queries
    del queries[:]
    await _commit(nodes[0], _rows("dev", _temp(5, 98)))
    assert HELD_WRITE in queries
    assert state_repo.LOCK_STATES not in queries
    assert metric.labels("written")._value.get() == 1


def test_a_node_finding_its_rows_written_by_others_again_locks_first_for_longer() -> None:
    """1, 2, 4, ... batches locked first after each contention in a row, at most
    HELD_SKIP_MAX; a batch written as held makes the next contention cost one batch again."""
    engine = AlarmEngine(rules=RULES, node_id="n", metrics=Metrics())
    skips = []
    for _ in range(11):
        engine._contended(True)
        skips.append(engine._held_skip)
    assert skips == [1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 256]
    assert HELD_SKIP_MAX == 256
    engine._contended(False)
    engine._contended(True)
    assert engine._held_skip == 1


async def test_rows_held_are_written_only_if_every_one_is_the_write_held(
    db: asyncpg.Connection,
) -> None:
    """write_held_states writes the changed rows only when every row the batch touches is
    still the write the caller holds (version, xmin and the server's run): one row held from
    another run of the server (a promoted standby reissues transaction ids) and nothing is
    written, the others included."""
    version = rule_version(RULES.by_key("temp-high"))  # type: ignore[arg-type]
    keys = [(f"dev-{n}", "temp-high", version) for n in range(2)]
    async with db.transaction():
        rows = [e.row for e in await state_repo.lock_states(db, keys)]
        xmin = await state_repo.write_states(db, rows, "a")
    xid, _, started = xmin.partition("@")
    rows = [msgspec.structs.replace(r, version=1) for r in rows]
    moved = [msgspec.structs.replace(r, last_seq=9) for r in rows]
    elsewhere = [(r.device_id, r.rule_key, f"1.{xid}@{int(started) - 1}") for r in rows]
    held = [(r.device_id, r.rule_key, f"1.{xid}@{started}") for r in rows]
    async with db.transaction():
        mixed = [held[0], elsewhere[1]]
        assert await state_repo.write_held_states(db, mixed, moved, "a") is None
    assert [
        (await state_repo.get_state(db, r.device_id, r.rule_key))["last_seq"] for r in rows
    ] == [  # type: ignore[index]
        None,
        None,
    ]
    async with db.transaction():
        written = await state_repo.write_held_states(db, held, moved[:1], "a")
    assert written is not None
    assert written.endswith(f"@{started}")
    got = [await state_repo.get_state(db, r.device_id, r.rule_key) for r in rows]
    assert [(g["last_seq"], g["version"]) for g in got] == [(9, 2), (None, 1)]  # type: ignore[index]
