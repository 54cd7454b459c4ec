"""An SOS and its SOS_CLEAR dated alike (a clock of one-second resolution: pressed and
released within the second), told apart by seq, committed out of order by two nodes: seq
says the SOS came first, so the SOS is raised already cleared by its clear, as an event
committed after its own clear always is (docs/behaviour.md §4: seq orders a device's samples
first; "Samples out of order")."""

from __future__ import annotations

from datetime import UTC, datetime

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


async def _store(engine: AlarmEngine, db: asyncpg.Connection, message: Telemetry) -> BatchAlarms:
    row = ("pendant-1", telemetry_event_id("pendant-1", message), message)
    async with db.transaction():
        batch = await engine.on_stored(db, [row])
    engine.committed(batch)
    return batch


async def test_an_sos_older_by_seq_than_its_clear_of_the_same_second_is_raised_cleared(
    db: asyncpg.Connection,
) -> None:
    now = await db.fetchval("SELECT now()")
    assert isinstance(now, datetime)
    second = now.astimezone(UTC).replace(microsecond=0)
    sos = Telemetry(ts=second, seq=41, events=[{"type": "SOS"}])
    clear = Telemetry(ts=second, seq=42, events=[{"type": "SOS_CLEAR"}])
    await _store(_node("node-a"), db, clear)
    await _store(_node("node-b"), db, sos)
    alarm = await db.fetchrow("SELECT id, status, cleared_at, clear_event_id FROM alarm")
    assert alarm is not None
    assert alarm["status"] == "NEW"
    assert alarm["clear_event_id"] == telemetry_event_id("pendant-1", clear), dict(alarm)
    events = await db.fetch(
        "SELECT event_type FROM outbox_event WHERE aggregate_id = $1 ORDER BY id",
        str(alarm["id"]),
    )
    assert [e["event_type"] for e in events] == ["alarm.created", "alarm.cleared"]


async def test_an_sos_older_by_seq_than_the_alarm_of_the_same_second_joins_it(
    db: asyncpg.Connection,
) -> None:
    """SOS seq 43 raised an alarm a carer confirmed; SOS seq 41 of the same second commits
    after it on another node: by seq it came first, so it joins the open alarm (created
    superseded by it), as an older occurrence does; it does not ring people again as a new
    alarm that takes the active key from the one the carer is on."""
    now = await db.fetchval("SELECT now()")
    assert isinstance(now, datetime)
    second = now.astimezone(UTC).replace(microsecond=0)
    await _store(_node("node-a"), db, Telemetry(ts=second, seq=43, events=[{"type": "SOS"}]))
    newer_id = await db.fetchval("SELECT id FROM alarm")
    async with db.transaction():
        await transition(db, newer_id, Action.CONFIRM, actor="op:carer", node_id="api")
    late = await _store(_node("node-b"), db, Telemetry(ts=second, seq=41, events=[{"type": "SOS"}]))
    assert late.late == 1
    rows = await db.fetch("SELECT id, status, active_key, superseded_by FROM alarm ORDER BY id")
    assert [(r["status"], r["active_key"], r["superseded_by"]) for r in rows] == [
        ("CONFIRMED", "pendant-1:sos", None),
        ("SUPERSEDED", None, newer_id),
    ], [dict(r) for r in rows]
