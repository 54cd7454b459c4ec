"""A `for_samples` rule across nodes that commit one device's samples out of step.

Each "node" stores a batch as the daemon does: the telemetry rows, then the engine on the same
transaction. The commit order is chosen by the test. What is asserted is the reference's
decision (one node reading the device's samples in device order, `evaluate` on a fresh state):
every run that reached `for_samples` has exactly one alarm, raised by a sample of that run,
cleared exactly when the run was cleared; no other alarm. Before late samples were judged from
the stored samples of their run (gateway.domain.rules.runs), a run whose samples were committed
after the clear that ended it was never raised.

The randomised test is seeded; a failing seed prints the command that replays it.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
import pytest

from gateway.alarms import engine as engine_module
from gateway.alarms.engine import AlarmEngine
from gateway.domain.rules import (
    Clearing,
    Firing,
    RuleConfig,
    RuleStates,
    compile_rules,
    evaluate,
)
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id
from storage import ingest as ingest_repo
from storage import rule_state as state_repo

T0 = 1_767_225_600_000
SLOW = RuleConfig(
    key="hot-3", kind="threshold", metric="temp", op=">", value=80, clear_value=75,
    for_samples=3, severity="MAJOR",
)  # fmt: skip
RULES = compile_rules([SLOW])
HOT, BAND, COOL = 95.0, 77.0, 70.0


def _sample(seq: int, temp: float) -> Telemetry:
    return Telemetry(ts=T0 + seq * 1000, seq=seq, metrics={"temp": temp})


@dataclass(frozen=True)
class _Stored:
    device: str
    event_id: str
    message: Telemetry


def _stream(device: str, temps: Sequence[float]) -> list[_Stored]:
    samples = [_sample(seq, temp) for seq, temp in enumerate(temps)]
    return [_Stored(device, telemetry_event_id(device, m), m) for m in samples]


async def _commit(
    engine: AlarmEngine,
    conn: asyncpg.Connection,
    batch: list[_Stored],
    *,
    now: datetime | None = None,
) -> None:
    """One node's batch: its telemetry, then its rules, in one transaction (as the daemon);
    judged at the database's time, or at ``now``."""
    rows = [
        ingest_repo.TelemetryRow(
            s.event_id, s.device, s.message.micros(), s.message.seq,
            json.dumps(s.message.metrics), None,
        )
        for s in batch
    ]  # fmt: skip
    async with conn.transaction():
        new = await ingest_repo.insert_telemetry(conn, rows, engine.node_id)
        fresh = [(s.device, s.event_id, s.message) for s in batch if s.event_id in new]
        alarms = await engine.on_stored(conn, fresh, now=now)
    engine.committed(alarms)


@dataclass(frozen=True)
class _Episode:
    """A reference firing: raised by `trigger`, over the samples after `after` up to
    `cleared_at` (None: still standing)."""

    trigger: str
    after: datetime
    cleared_at: datetime | None


def _reference(stream: list[_Stored]) -> list[_Episode]:
    """One node reading the device's samples in device order: each firing, from the last
    clearing sample before it to the clearing that ended it."""
    states: RuleStates = {}
    episodes: list[_Episode] = []
    standing: tuple[str, datetime] | None = None
    after = datetime.min.replace(tzinfo=stream[0].message.timestamp().tzinfo)
    for s in sorted(stream, key=lambda s: s.message.seq or 0):
        for outcome in evaluate(RULES, states, s.device, s.event_id, s.message).outcomes:
            if isinstance(outcome, Firing):
                assert standing is None  # the rule clears before it fires again
                standing = (outcome.telemetry_event_id, after)
            elif isinstance(outcome, Clearing) and standing is not None:
                episodes.append(_Episode(standing[0], standing[1], outcome.observed_at))
                standing = None
        assert s.message.metrics is not None
        if s.message.metrics["temp"] == COOL:
            after = s.message.timestamp()
    if standing is not None:
        episodes.append(_Episode(standing[0], standing[1], None))
    return episodes


async def _differences(db: asyncpg.Connection, device: str, stream: list[_Stored]) -> list[str]:
    """How the stored alarms of `device` differ from the reference's episodes (none: equal)."""
    ts_of = {s.event_id: s.message.timestamp() for s in stream}
    seq_of = {s.event_id: s.message.seq for s in stream}
    alarms = await db.fetch(
        "SELECT telemetry_event_id, cleared_at IS NOT NULL AS cleared"
        " FROM alarm WHERE device_id = $1 AND rule_key = $2 ORDER BY id",
        device,
        SLOW.key,
    )
    differences: list[str] = []
    matched: set[str] = set()
    for episode in _reference(stream):
        inside = [
            a["telemetry_event_id"]
            for a in alarms
            if episode.after < ts_of[a["telemetry_event_id"]]
            and (episode.cleared_at is None or ts_of[a["telemetry_event_id"]] <= episode.cleared_at)
        ]
        matched.update(inside)
        trigger = seq_of[episode.trigger]
        if not inside:
            differences.append(f"{device}: missed the run raised on seq {trigger}")
        elif len(inside) > 1:
            differences.append(f"{device}: {len(inside)} alarms for the run of seq {trigger}")
        cleared = {a["telemetry_event_id"]: a["cleared"] for a in alarms}
        if inside and cleared[inside[0]] != (episode.cleared_at is not None):
            differences.append(f"{device}: the run of seq {trigger} cleared is wrong")
    extra = sorted(
        seq_of[a["telemetry_event_id"]] for a in alarms if a["telemetry_event_id"] not in matched
    )
    if extra:
        differences.append(f"{device}: {EXTRA} on seqs {extra}")
    return differences


# An alarm device order never raises: a run counted on the samples that had arrived, while a
# break between them was still in flight on another node (docs/rules-and-alarms.md, "Runs of
# samples across nodes"). It is raised, then cleared by the next clearing sample.
EXTRA = "alarms device order never raises"


async def _check(db: asyncpg.Connection, device: str, stream: list[_Stored]) -> list[str]:
    """Assert no run missed, none raised twice, each cleared as device order clears it;
    return the alarms device order never raises (see EXTRA)."""
    differences = await _differences(db, device, stream)
    assert [d for d in differences if EXTRA not in d] == []
    return differences


@pytest.fixture
async def three(db_dsn: str) -> AsyncIterator[list[tuple[AlarmEngine, asyncpg.Connection]]]:
    conns = [await asyncpg.connect(db_dsn) for _ in range(3)]
    engines = [AlarmEngine(rules=RULES, node_id=f"node-{n}", metrics=Metrics()) for n in "abc"]
    try:
        yield list(zip(engines, conns, strict=True))
    finally:
        for conn in conns:
            await conn.close()


async def test_a_run_committed_after_its_own_clear_is_raised_already_cleared(
    three: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    """Eight hot samples, then cool ones: node B commits the last hot one and the first cool
    one before node A commits the other seven. The run reached three samples in device order:
    its alarm is raised on its third sample, cleared by the first cool one."""
    stream = _stream("dev", [HOT] * 8 + [COOL] * 4)
    (a, conn_a), (b, conn_b), _ = three
    await _commit(b, conn_b, stream[7:9])
    assert await db.fetchval("SELECT count(*) FROM alarm") == 0  # 1 violation, then a clear
    await _commit(a, conn_a, stream[:7])
    row = await db.fetchrow("SELECT telemetry_event_id, cleared_at, clear_event_id FROM alarm")
    assert row is not None
    assert row["telemetry_event_id"] == stream[2].event_id  # the run's third sample
    assert row["cleared_at"] is not None
    assert row["clear_event_id"] == stream[8].event_id
    await _commit(a, conn_a, stream[9:])
    assert await _check(db, "dev", stream) == []
    state = await db.fetchrow(
        "SELECT firing, pending_count FROM rule_state WHERE device_id = 'dev'"
    )
    assert state is not None
    assert (state["firing"], state["pending_count"]) == (False, 0)
    judged = a.alarm_metrics.late_runs.labels("raised")._value.get()
    assert judged == 1


async def test_a_late_break_splits_the_pending_run(
    three: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    """Hot, in band, hot, hot: in device order the band sample breaks the run (two, not four,
    in a row). Node B commits the hot samples first; node A's late band sample must split
    what B counted, so the next hot sample (the third in a row only after it) fires, and not
    before."""
    stream = _stream("dev", [HOT, BAND, HOT, HOT, HOT, COOL])
    (a, conn_a), (b, conn_b), _ = three
    await _commit(b, conn_b, [stream[0], stream[2]])  # pending 2 (device order: 1, then 1)
    await _commit(a, conn_a, [stream[1]])  # the late break
    await _commit(b, conn_b, [stream[3]])  # 2 in a row in device order: nothing yet
    assert await db.fetchval("SELECT count(*) FROM alarm") == 0
    await _commit(b, conn_b, [stream[4]])  # the third in a row
    assert await db.fetchval("SELECT telemetry_event_id FROM alarm") == stream[4].event_id
    await _commit(b, conn_b, [stream[5]])
    assert await _check(db, "dev", stream) == []


async def test_a_run_whose_clear_is_still_in_flight_waits_for_it(
    three: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    """Cool, three hot, cool, four hot, cool. Node B counts 1, 2 and 5 as three in a row (3
    and 4 are still on node A) and raises on 5. Node A's late 3 completes the first run in
    device order, but whether 4 ends it, or the alarm on 5 stands for a longer run, is not
    known until 4 arrives: nothing is raised yet. When 4 (a clear) arrives, the first run's
    alarm is raised on its third sample, superseded by the alarm on 5, cleared by 4."""
    stream = _stream("dev", [COOL, HOT, HOT, HOT, COOL, HOT, HOT, HOT, HOT, COOL])
    (a, conn_a), (b, conn_b), _ = three
    await _commit(b, conn_b, stream[0:3])
    await _commit(b, conn_b, stream[5:8])
    assert await db.fetchval("SELECT telemetry_event_id FROM alarm") == stream[5].event_id
    await _commit(a, conn_a, [stream[3]])
    assert await db.fetchval("SELECT count(*) FROM alarm") == 1
    await _commit(a, conn_a, [stream[4]])
    first = await db.fetchrow(
        "SELECT status, cleared_at IS NOT NULL AS cleared, clear_event_id FROM alarm"
        " WHERE telemetry_event_id = $1",
        stream[3].event_id,
    )
    assert first is not None
    assert dict(first) == {
        "status": "SUPERSEDED", "cleared": True, "clear_event_id": stream[4].event_id,
    }  # fmt: skip
    await _commit(b, conn_b, stream[8:])
    assert await _check(db, "dev", stream) == []


SEEDS = int(os.environ.get("GATEWAY_RULE_RUN_SEEDS", "12"))
FIRST_SEED = int(os.environ.get("GATEWAY_RULE_RUN_SEED", "1"))


def _temps(rng: random.Random, count: int) -> list[float]:
    temps: list[float] = []
    while len(temps) < count:
        temps += [rng.choice([HOT, HOT, BAND, COOL])] * rng.randint(1, 6)
    return temps[:count]


def _interleaving(
    rng: random.Random, stream: list[_Stored], nodes: int
) -> list[tuple[int, list[_Stored]]]:
    """Each sample goes to one node; each node cuts what it got into batches in arrival order;
    the batches commit in an order that keeps each node's own in turn."""
    got: list[list[_Stored]] = [[] for _ in range(nodes)]
    for s in stream:
        got[rng.randrange(nodes)].append(s)
    queues: list[list[list[_Stored]]] = []
    for items in got:
        batches, start = [], 0
        while start < len(items):
            size = rng.randint(1, 8)
            batches.append(items[start : start + size])
            start += size
        queues.append(batches)
    order: list[tuple[int, list[_Stored]]] = []
    while any(queues):
        node = rng.choice([n for n, q in enumerate(queues) if q])
        order.append((node, queues[node].pop(0)))
    return order


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SEEDS))
async def test_three_nodes_in_any_commit_order_raise_what_device_order_raises(
    three: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection, seed: int
) -> None:
    rng = random.Random(seed)
    streams = {f"dev-{d}": _stream(f"dev-{d}", _temps(rng, 60)) for d in range(4)}
    everything = [s for stream in streams.values() for s in stream]
    try:
        for node, batch in _interleaving(rng, everything, len(three)):
            engine, conn = three[node]
            await _commit(engine, conn, batch)
        extra = [d for device, stream in streams.items() for d in await _check(db, device, stream)]
        # Measured over seeds 1-210: 2 seeds with one such alarm each (55 and 94), none in the
        # default range. More than one in a seed is not that limit any more.
        assert len(extra) <= 1, extra
    except AssertionError:
        print(
            "replay: GATEWAY_RULE_RUN_SEED="
            f"{seed} GATEWAY_RULE_RUN_SEEDS=1 pytest -q {__file__}"
            " -k test_three_nodes_in_any_commit_order"
        )
        raise


HELD_SEEDS = int(os.environ.get("GATEWAY_HELD_SEEDS", "6"))
FIRST_HELD_SEED = int(os.environ.get("GATEWAY_HELD_SEED", "1"))
QUICK = RuleConfig(
    key="hot-now", kind="threshold", metric="temp", op=">", value=90, clear_value=75,
    severity="CRITICAL",
)  # fmt: skip
DOOR = RuleConfig(key="door", kind="event", event="DOOR_OPEN", severity="MAJOR")
MIXED = compile_rules([SLOW, QUICK, DOOR])
# The same rules after a SIGHUP that changed one (its state restarts its count).
RELOADED = compile_rules([SLOW, msgspec.structs.replace(QUICK, value=88), DOOR])
# The receipt of the equivalence test's batches: a day after the samples' time.
RECEIPT_MS = T0 + 86_400_000


def _field_stream(rng: random.Random, device: str, count: int) -> list[_Stored]:
    """A device's samples as the field delivers them: mostly in order, some swapped with the
    next, some late by a few places (placed by the rule state or judged from the stored run),
    some from a clock set back beyond the reorder window, ahead of the receipt by hours or
    reset to 1970, some with a door event."""
    messages = []
    for seq, temp in enumerate(_temps(rng, count)):
        clock = rng.random()
        ts = T0 + seq * 1000
        if clock < 0.03:
            ts -= 3_600_000  # set back an hour
        elif clock < 0.05:
            ts = RECEIPT_MS + 8 * 3_600_000  # 8 hours ahead of the receipt
        elif clock < 0.07:
            ts = seq * 1000  # reset to 1970
        events = [{"type": "DOOR_OPEN"}] if rng.random() < 0.1 else None
        messages.append(Telemetry(ts=ts, seq=seq, metrics={"temp": temp}, events=events))
    for i in range(len(messages) - 1):
        if rng.random() < 0.1:
            messages[i], messages[i + 1] = messages[i + 1], messages[i]
    for _ in range(count // 20):
        late = rng.randrange(len(messages) - 1)
        messages.insert(min(len(messages), late + rng.randint(2, 6)), messages.pop(late))
    return [_Stored(device, telemetry_event_id(device, m), m) for m in messages]


async def _decided(db: asyncpg.Connection, prefix: str) -> tuple[list[object], list[object]]:
    """Every alarm and rule-state row of the devices named with `prefix`, by device suffix,
    rule and sample (not event id: the ids differ with the device's name)."""
    alarms = await db.fetch(
        "SELECT substr(a.device_id, length($1) + 1) AS device, a.rule_key, t.seq, a.status,"
        " a.cleared_at IS NOT NULL AS cleared, a.superseded_by IS NOT NULL AS superseded"
        " FROM alarm a LEFT JOIN telemetry t ON t.event_id = a.telemetry_event_id"
        " WHERE a.device_id LIKE $1 || '%' ORDER BY 1, 2, 3",
        prefix,
    )
    states = await db.fetch(
        "SELECT substr(device_id, length($1) + 1) AS device, rule_key, rule_version, firing,"
        " pending_count, pending_since, last_ts, last_seq, fired_ts, released_ts, clear_ts,"
        " violating_ts FROM rule_state WHERE device_id LIKE $1 || '%' ORDER BY 1, 2",
        prefix,
    )
    return [tuple(r) for r in alarms], [tuple(r) for r in states]


@pytest.mark.parametrize("seed", range(FIRST_HELD_SEED, FIRST_HELD_SEED + HELD_SEEDS))
async def test_a_node_judging_from_its_held_rows_decides_as_one_that_locks_every_batch(
    db: asyncpg.Connection, db_dsn: str, seed: int
) -> None:
    """The same batches of field-order samples (swapped, late, clocks set back, ahead and
    reset to 1970, events) on two sets of devices, with a reload that changes a rule half-way:
    one node judges from the rows it holds where it can (locking and writing them in one
    statement), the other locks and reads its rows before every batch. Every alarm and every
    rule-state row come out the same."""
    rng = random.Random(seed)
    held = AlarmEngine(rules=MIXED, node_id="held", metrics=Metrics())
    locking = AlarmEngine(rules=MIXED, node_id="locking", metrics=Metrics())
    conns = [await asyncpg.connect(db_dsn) for _ in range(2)]
    try:
        streams = [_field_stream(rng, f"{d}", 80) for d in range(4)]
        # Each device's samples keep their delivery order; the devices take turns.
        order = []
        for turn in zip(*streams, strict=True):
            order += rng.sample(turn, len(turn))
        cuts = sorted(rng.sample(range(1, len(order)), 40))
        batches = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
        # Samples set back beyond the reorder window are judged at their receipt: the same
        # receipt for both nodes' batch.
        receipt = datetime.fromtimestamp(RECEIPT_MS / 1000, tz=UTC)
        for n, batch in enumerate(batches):
            locking._held_skip = len(batches)  # never judges from held rows
            if n == len(batches) // 2:  # a SIGHUP on both, between batches
                held.replace_rules(RELOADED)
                locking.replace_rules(RELOADED)
            for engine, conn, prefix in ((held, conns[0], "h-"), (locking, conns[1], "l-")):
                named = [
                    _Stored(
                        prefix + s.device,
                        telemetry_event_id(prefix + s.device, s.message),
                        s.message,
                    )
                    for s in batch
                ]
                await _commit(engine, conn, named, now=receipt + timedelta(seconds=n))
        assert await _decided(db, "h-") == await _decided(db, "l-")
        adjusted = held.alarm_metrics.clock_adjustments
        for reason in ("ahead", "behind"):  # the clocks' faults were in the stream
            assert adjusted.labels(reason)._value.get() > 0, reason
        written = held.alarm_metrics.held_batches.labels("written")._value.get()
        assert written >= len(batches) // 2, written  # the held path was taken, mostly
        assert locking.alarm_metrics.held_batches.labels("written")._value.get() == 0
    except AssertionError:
        print(
            f"replay: GATEWAY_HELD_SEED={seed} GATEWAY_HELD_SEEDS=1 pytest -q {__file__}"
            " -k test_a_node_judging_from_its_held_rows"
        )
        raise
    finally:
        for conn in conns:
            await conn.close()


async def test_a_held_batch_with_a_late_sample_is_judged_once_under_the_lock(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hot samples 0-2 raise the alarm, cool 4 clears it, then hot 3 comes late: the state
    cannot place it, so its run is judged from the stored samples under the lock. The batch
    was judged from the rows held first; the lock finds them as held, so that judgement
    stands: each message is evaluated once, and the late run is judged: its one alarm,
    raised by sample 2 and cleared by 4, stays the only one, as on a node that locked first."""
    engine = AlarmEngine(rules=RULES, node_id="n", metrics=Metrics())
    conn = await asyncpg.connect(db_dsn)
    calls: list[str] = []
    judged = engine_module.evaluate

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[3])  # the event id
        return judged(*args, **kwargs)

    monkeypatch.setattr(engine_module, "evaluate", counted)
    try:
        stream = _stream("dev", [HOT, HOT, HOT, HOT, COOL])
        await _commit(engine, conn, stream[:3])
        await _commit(engine, conn, [stream[4]])
        del calls[:]
        statements: list[str] = []
        conn.add_query_logger(lambda logged: statements.append(logged.query))
        await _commit(engine, conn, [stream[3]])
        assert calls == [stream[3].event_id]  # evaluated once
        assert state_repo.LOCK_STATES in statements
        assert engine.alarm_metrics.late_runs.labels("judged")._value.get() == 1
        assert engine.alarm_metrics.held_batches.labels("contended")._value.get() == 0
        alarms = await conn.fetch(
            "SELECT telemetry_event_id, cleared_at IS NOT NULL AS cleared FROM alarm ORDER BY id"
        )
        assert [(a["telemetry_event_id"], a["cleared"]) for a in alarms] == [
            (stream[2].event_id, True)
        ]
    finally:
        await conn.close()


async def test_a_late_run_is_not_judged_with_a_sample_a_clock_dated_hours_ahead(
    three: list[tuple[AlarmEngine, asyncpg.Connection]], db: asyncpg.Connection
) -> None:
    """No seq. The device's clock ran 8 hours ahead when it sent 95 (dated 8 hours on, judged
    at its receipt); NTP set it, and it sent 70, 85, 85: node A counts two in a row. Node B
    then commits a late 85 dated before the 70, a violation outside the pending run: its run
    is judged from the stored samples. In device order, as the row judged them, nothing
    reached three in a row (95 and the late 85, a clear, 85 and 85). Read by device time, the
    95 dated ahead came after the last 85, a third in a row: a false alarm, raised late, and
    the row left firing on a device whose newest sample is the second 85 of a pending run."""
    now = await db.fetchval("SELECT now()")
    (a, conn_a), (b, conn_b), _ = three

    def sample(after: timedelta, temp: float) -> _Stored:
        message = Telemetry(ts=now + after, metrics={"temp": temp})
        return _Stored("dev", telemetry_event_id("dev", message), message)

    await _commit(a, conn_a, [sample(timedelta(hours=8), HOT)])  # judged at its receipt
    await _commit(a, conn_a, [sample(timedelta(seconds=2), COOL)])
    await _commit(a, conn_a, [sample(timedelta(seconds=4), 85.0)])
    await _commit(a, conn_a, [sample(timedelta(seconds=6), 85.0)])
    await _commit(b, conn_b, [sample(timedelta(seconds=1), 85.0)])  # late, outside the run
    assert await db.fetchval("SELECT count(*) FROM alarm") == 0, "raised with the 95 ahead"
    state = await db.fetchrow(
        "SELECT firing, pending_count FROM rule_state WHERE device_id = 'dev'"
    )
    assert state is not None
    assert (state["firing"], state["pending_count"]) == (False, 2)
