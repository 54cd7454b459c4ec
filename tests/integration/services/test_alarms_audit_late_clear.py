"""A late occurrence raised on its own (the newer alarm of its rule had ended) keeps its clear:
an event committed after its own clear still becomes an alarm, already cleared
(docs/behaviour.md §4, "Samples out of order"). Two nodes on one database."""

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


def _event(ts: datetime, kind: str) -> Telemetry:
    return Telemetry(ts=ts, events=[{"type": kind}])


async def _store(engine: AlarmEngine, db: asyncpg.Connection, message: Telemetry) -> BatchAlarms:
    row = ("pendant-1", telemetry_event_id("pendant-1", message), message)
    async with db.transaction():
        batch = await engine.on_stored(db, [row])
    engine.committed(batch)
    return batch


async def _db_now(db: asyncpg.Connection) -> datetime:
    now = await db.fetchval("SELECT now()")
    assert isinstance(now, datetime)
    return now.astimezone(UTC)


async def _late_sos_after_its_clear(db: asyncpg.Connection, last: Action) -> asyncpg.Record:
    """SOS at -20 s (node B, committed last), SOS_CLEAR at -15 s and SOS at -10 s (node A,
    committed first); people took the -10 s alarm up to ``last`` before the late SOS came."""
    node_a, node_b = _node("node-a"), _node("node-b")
    now = await _db_now(db)
    clear = _event(now - timedelta(seconds=15), "SOS_CLEAR")
    await _store(node_a, db, clear)
    await _store(node_a, db, _event(now - timedelta(seconds=10), "SOS"))
    newer_id = await db.fetchval("SELECT id FROM alarm")
    for action in (Action.CONFIRM, Action.HANDLE, Action.CLOSE):
        async with db.transaction():
            await transition(db, newer_id, action, actor="op:carer", node_id="api")
        if action is last:
            break
    late = await _store(node_b, db, _event(now - timedelta(seconds=20), "SOS"))
    assert late.late == 1
    older = await db.fetchrow(
        "SELECT id, status, cleared_at, clear_event_id FROM alarm WHERE id <> $1", newer_id
    )
    assert older is not None
    assert older["status"] == "NEW"
    # Cleared by the SOS_CLEAR that followed it on the device, as the contract says, with the
    # alarm.cleared event every clear publishes.
    assert older["clear_event_id"] == telemetry_event_id("pendant-1", clear), dict(older)
    assert older["cleared_at"] is not None
    events = await db.fetch(
        "SELECT event_type FROM outbox_event WHERE aggregate_id = $1 ORDER BY id",
        str(older["id"]),
    )
    assert [e["event_type"] for e in events] == ["alarm.created", "alarm.cleared"]
    return older


async def test_a_late_sos_whose_newer_alarm_was_closed_is_raised_already_cleared(
    db: asyncpg.Connection,
) -> None:
    await _late_sos_after_its_clear(db, Action.CLOSE)


async def test_a_late_sos_whose_newer_alarm_was_handled_is_raised_already_cleared(
    db: asyncpg.Connection,
) -> None:
    await _late_sos_after_its_clear(db, Action.HANDLE)
