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
