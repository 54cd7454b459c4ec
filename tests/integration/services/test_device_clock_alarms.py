"""Alarms that device clocks cannot hide, on two nodes sharing one database: a clock set
ahead, a clock reset to 1970, and a late occurrence whose newer alarm people already closed.
Every sample is judged against the database's clock (the receipt), as the daemon does."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.alarms.lifecycle import transition
from gateway.domain.alarm import Action
from gateway.domain.rules import DeviceClock, RuleConfig, compile_rules
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id

RULES = compile_rules([RuleConfig(key="sos", kind="event", event="SOS", severity="CRITICAL")])


def _node(name: str) -> AlarmEngine:
    return AlarmEngine(rules=RULES, node_id=name, metrics=Metrics(), clock=DeviceClock())


def _sos(ts: datetime) -> Telemetry:
    return Telemetry(ts=ts, events=[{"type": "SOS"}])


async def _store(engine: AlarmEngine, db: asyncpg.Connection, message: Telemetry) -> BatchAlarms:
    row = ("pendant-1", telemetry_event_id("pendant-1", message), message)
    async with db.transaction():
        batch = await engine.on_stored(db, [row])
    engine.committed(batch)
    return batch


async def _close(db: asyncpg.Connection, alarm_id: int) -> None:
    for action in (Action.CONFIRM, Action.HANDLE, Action.CLOSE):
        async with db.transaction():
            await transition(db, alarm_id, action, actor="op:carer", node_id="api")


async def _alarms(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return await db.fetch("SELECT id, status, superseded_by, trigger FROM alarm ORDER BY id")


async def _db_now(db: asyncpg.Connection) -> datetime:
    now = await db.fetchval("SELECT now()")
    assert isinstance(now, datetime)
    return now.astimezone(UTC)


async def test_a_clock_set_ahead_does_not_hide_the_next_sos(db: asyncpg.Connection) -> None:
    node_a, node_b = _node("node-a"), _node("node-b")
    now = await _db_now(db)
    ahead = await _store(node_a, db, _sos(now + timedelta(hours=8)))
    (first,) = await _alarms(db)
    await _close(db, first["id"])
    # The real SOS, judged by the other node: an alarm of its own, open for people.
    real = await _store(node_b, db, _sos(now + timedelta(seconds=1)))
    assert len(real.created) == 1
    first, second = await _alarms(db)
    assert first["status"] == "CLOSED"
    assert (second["status"], second["superseded_by"]) == ("NEW", None)
    assert ahead.clock_adjustments == {"ahead": 1}
    assert (
        node_a.metrics.registry.get_sample_value(
            "gateway_clock_adjustments_total", {"reason": "ahead"}
        )
        == 1
    )


async def test_a_clock_reset_to_1970_raises_its_sos(db: asyncpg.Connection) -> None:
    node_a, node_b = _node("node-a"), _node("node-b")
    now = await _db_now(db)
    await _store(node_a, db, _sos(now))
    (first,) = await _alarms(db)
    await _close(db, first["id"])
    rebooted = await _store(node_b, db, _sos(datetime(1970, 1, 1, 0, 0, 7, tzinfo=UTC)))
    assert rebooted.clock_adjustments == {"behind": 1}
    _, second = await _alarms(db)
    assert (second["status"], second["superseded_by"]) == ("NEW", None)


async def test_a_late_occurrence_whose_newer_alarm_was_closed_is_raised_on_its_own(
    db: asyncpg.Connection,
) -> None:
    """Two nodes commit one pendant's two SOS out of order, seconds apart (inside the reorder
    window); people closed the newer alarm before the older SOS committed."""
    node_a, node_b = _node("node-a"), _node("node-b")
    now = await _db_now(db)
    await _store(node_a, db, _sos(now - timedelta(seconds=10)))
    (newer,) = await _alarms(db)
    await _close(db, newer["id"])
    late = await _store(node_b, db, _sos(now - timedelta(seconds=20)))
    assert late.late == 1
    _, older = await _alarms(db)
    assert (older["status"], older["superseded_by"]) == ("NEW", None)
    created = await db.fetchval(
        "SELECT payload::text FROM outbox_event WHERE aggregate_id = $1", str(older["id"])
    )
    assert "(late: the newer alarm of its rule had ended)" in created


async def test_a_late_occurrence_whose_newer_alarm_is_open_joins_it(db: asyncpg.Connection) -> None:
    node_a, node_b = _node("node-a"), _node("node-b")
    now = await _db_now(db)
    await _store(node_a, db, _sos(now - timedelta(seconds=10)))
    await _store(node_b, db, _sos(now - timedelta(seconds=20)))
    newer, older = await _alarms(db)
    assert newer["status"] == "NEW"
    assert (older["status"], older["superseded_by"]) == ("SUPERSEDED", newer["id"])


async def test_a_late_occurrence_whose_newer_alarm_was_handled_is_raised_on_its_own(
    db: asyncpg.Connection,
) -> None:
    """A clock 200 s ahead (inside max_future_skew_s): the first SOS is dated 200 s ahead, and
    a carer handles its alarm. NTP steps the clock back, and a new SOS a minute later is dated
    before the first: late. A handled alarm is done with for people (nobody is notified of
    what joins it): the new SOS is an alarm of its own, open, never hung off it."""
    node_a, node_b = _node("node-a"), _node("node-b")
    now = await _db_now(db)
    await _store(node_a, db, _sos(now + timedelta(seconds=200)))
    (handled,) = await _alarms(db)
    for action in (Action.CONFIRM, Action.HANDLE):
        async with db.transaction():
            await transition(db, handled["id"], action, actor="op:carer", node_id="api")
    late = await _store(node_b, db, _sos(now + timedelta(seconds=60)))
    assert late.late == 1
    first, second = await _alarms(db)
    assert first["status"] == "HANDLED"
    assert (second["status"], second["superseded_by"]) == ("NEW", None)


# --- clocks past the bounds and corrected clocks, on two nodes -----------------------------

HOT = compile_rules(
    [
        RuleConfig(
            key="hot", kind="threshold", metric="temp", op=">", value=50, clear_value=40,
            severity="MAJOR",
        )
    ]
)  # fmt: skip


def _sensor_node(name: str) -> AlarmEngine:
    return AlarmEngine(rules=HOT, node_id=name, metrics=Metrics(), clock=DeviceClock())


def _temp(ts: datetime, value: float, seq: int | None = None) -> Telemetry:
    return Telemetry(ts=ts, seq=seq, metrics={"temp": value})


async def _store_all(
    engine: AlarmEngine, db: asyncpg.Connection, messages: list[Telemetry]
) -> BatchAlarms:
    rows = [("sensor-1", telemetry_event_id("sensor-1", m), m) for m in messages]
    async with db.transaction():
        batch = await engine.on_stored(db, rows)
    engine.committed(batch)
    return batch


async def _active(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return await db.fetch("SELECT id, trigger FROM alarm WHERE cleared_at IS NULL ORDER BY id")


async def _state(db: asyncpg.Connection) -> asyncpg.Record:
    row = await db.fetchrow(
        "SELECT firing, last_ts, last_seq, last_device_ts FROM rule_state"
        " WHERE device_id = 'sensor-1' AND rule_key = 'hot'"
    )
    assert row is not None
    return row


EPOCH = datetime(1970, 1, 1, 0, 0, 5, tzinfo=UTC)


async def test_a_clock_past_the_bounds_reordered_between_nodes_leaves_no_alarm_active(
    db: asyncpg.Connection,
) -> None:
    """A sensor rebooted to 1970 (seq restarts): seq 1 says 60, seq 2 says 30. Node b commits
    seq 2 first; node a commits seq 1 after it, in a later transaction (a later receipt).
    seq 1 is late, its alarm cleared by seq 2; it used to be taken for a new epoch and left
    its alarm active on a sensor back to normal. And the other way round (seq 1 clears, seq 2
    violates): the late clear leaves the newer alarm active; it used to clear it."""
    node_a, node_b = _sensor_node("node-a"), _sensor_node("node-b")
    now = await _db_now(db)
    await _store_all(node_a, db, [_temp(now, 45, seq=900)])
    rebooted = await _store_all(node_a, db, [_temp(EPOCH, 45, seq=0)])
    assert rebooted.clock_adjustments == {"behind": 1}
    await _store_all(node_b, db, [_temp(EPOCH + timedelta(seconds=2), 30, seq=2)])
    late = await _store_all(node_a, db, [_temp(EPOCH + timedelta(seconds=1), 60, seq=1)])
    assert late.clock_adjustments == {"behind": 1}
    assert len(late.created) == 1
    assert await _active(db) == []
    state = await _state(db)
    assert (state["firing"], state["last_seq"]) == (False, 2)
    assert state["last_device_ts"] == EPOCH + timedelta(seconds=2)
    # The next pair the other way round: seq 4 violates, committed first; seq 3 clears.
    await _store_all(node_b, db, [_temp(EPOCH + timedelta(seconds=4), 60, seq=4)])
    (raised,) = await _active(db)
    await _store_all(node_a, db, [_temp(EPOCH + timedelta(seconds=3), 30, seq=3)])
    assert [a["id"] for a in await _active(db)] == [raised["id"]]
    state = await _state(db)
    assert (state["firing"], state["last_seq"]) == (True, 4)


async def test_a_clock_ahead_past_the_bounds_reordered_between_nodes_is_late(
    db: asyncpg.Connection,
) -> None:
    node_a, node_b = _sensor_node("node-a"), _sensor_node("node-b")
    now = await _db_now(db)
    ahead = now + timedelta(hours=8)
    await _store_all(node_a, db, [_temp(ahead, 45, seq=10)])
    await _store_all(node_b, db, [_temp(ahead + timedelta(seconds=2), 30, seq=12)])
    late = await _store_all(node_a, db, [_temp(ahead + timedelta(seconds=1), 60, seq=11)])
    assert late.clock_adjustments == {"ahead": 1}
    assert await _active(db) == []
    assert (await _state(db))["last_seq"] == 12


async def test_a_clock_ahead_corrected_while_its_samples_wait_clears_on_two_nodes(
    db: asyncpg.Connection,
) -> None:
    """No seq. A sensor's clock runs 8 hours ahead: its 60 is judged at its batch's receipt.
    NTP corrects it; its next sample, 30, waited in a backlog and is dated before that
    receipt. Stored by the other node in a later batch, it clears; it used to be judged late
    and leave the alarm active."""
    node_a, node_b = _sensor_node("node-a"), _sensor_node("node-b")
    now = await _db_now(db)
    await _store_all(node_a, db, [_temp(now + timedelta(hours=8), 60)])
    assert len(await _active(db)) == 1
    # Dated before the receipt of node a's batch (which is after `now`).
    corrected = await _store_all(node_b, db, [_temp(now - timedelta(seconds=1), 30)])
    assert await _active(db) == []
    assert corrected.clock_adjustments == {"corrected": 1}
    state = await _state(db)
    assert state["last_device_ts"] == now - timedelta(seconds=1)
    # A sample sent before that one, committed after it by node a: late, as any reordering.
    late = await _store_all(node_a, db, [_temp(now - timedelta(seconds=2), 60)])
    assert late.clock_adjustments == {}
    assert await _active(db) == []
    assert not (await _state(db))["firing"]


async def test_a_clock_ahead_corrected_within_one_batch_clears(db: asyncpg.Connection) -> None:
    node = _sensor_node("node-a")
    now = await _db_now(db)
    batch = await _store_all(
        node, db, [_temp(now + timedelta(hours=8), 60), _temp(now - timedelta(seconds=1), 30)]
    )
    assert await _active(db) == []
    assert batch.clock_adjustments == {"ahead": 1, "corrected": 1}
