"""Alarms written in runs: a whole batch's firings in a few statements, same result as one by one.

The engine is driven directly with hand-made batches, so each test decides what one ingest
transaction holds.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.alarms.lifecycle import (
    AlarmRequest,
    SummarySpec,
    create_alarm,
    create_alarms,
)
from gateway.domain.alarm import dedup_key
from gateway.domain.errors import ConcurrentWriteError
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id
from protocol.events import EventType

T0 = 1_767_225_600_000
THRESHOLD = RuleConfig(
    key="temp-high", kind="threshold", metric="temp", op=">", value=80, clear_value=75,
    severity="CRITICAL",
)  # fmt: skip
RULES = compile_rules(
    [RuleConfig(key="door-open", kind="event", event="DOOR_OPEN", severity="MAJOR"), THRESHOLD]
)
SUMMARY = SummarySpec(model_name="test-model", prompt_version="v1")


def _temp(seq: int, value: float) -> Telemetry:
    return Telemetry(ts=T0 + seq, seq=seq, metrics={"temp": value})


def _event(seq: int, event_type: str) -> Telemetry:
    return Telemetry(ts=T0 + seq, seq=seq, events=[{"type": event_type}])


async def _batch(
    engine: AlarmEngine, db: asyncpg.Connection, messages: list[tuple[str, Telemetry]]
) -> BatchAlarms:
    """One ingest transaction's alarm work, committed."""
    rows = [(device, telemetry_event_id(device, message), message) for device, message in messages]
    async with db.transaction():
        batch = await engine.on_stored(db, rows)
    engine.committed(batch)
    return batch


async def _counted(
    engine: AlarmEngine, db: asyncpg.Connection, messages: list[tuple[str, Telemetry]]
) -> tuple[BatchAlarms, list[str]]:
    """`_batch`, and the statements it sent (BEGIN and COMMIT included)."""
    statements: list[str] = []

    def sent(record: asyncpg.connection.LoggedQuery) -> None:
        statements.append(record.query)

    db.add_query_logger(sent)
    try:
        return await _batch(engine, db, messages), statements
    finally:
        db.remove_query_logger(sent)


def _engine() -> AlarmEngine:
    engine = AlarmEngine(rules=RULES, node_id="node-a", metrics=Metrics())
    engine.summary = SUMMARY
    return engine


async def test_a_storm_in_one_batch_writes_each_alarm_with_its_audit_event_and_task(
    db: asyncpg.Connection,
) -> None:
    engine = _engine()
    devices = [f"dev-{n:03d}" for n in range(200)]
    await _batch(engine, db, [(d, _temp(0, 20.0)) for d in devices])
    batch = await _batch(engine, db, [(d, _temp(1, 95.0)) for d in devices])

    assert len(batch.created) == 200
    alarms = await db.fetch(
        "SELECT id, device_id, status, rule_key, dedup_key, active_key FROM alarm ORDER BY id"
    )
    assert [a["device_id"] for a in alarms] == devices  # in message order
    assert {a["status"] for a in alarms} == {"NEW"}
    for alarm in alarms:
        event = telemetry_event_id(alarm["device_id"], _temp(1, 95.0))
        assert alarm["dedup_key"] == dedup_key("temp-high", alarm["device_id"], event)
    audits = await db.fetch(
        "SELECT alarm_id, action, from_status, to_status, actor, event_id, node_id "
        "FROM alarm_audit ORDER BY id"
    )
    assert [a["alarm_id"] for a in audits] == [a["id"] for a in alarms]
    assert {(a["action"], a["from_status"], a["to_status"], a["actor"], a["node_id"])
            for a in audits} == {("create", None, "NEW", "system:rules", "node-a")}  # fmt: skip
    events = await db.fetch(
        "SELECT aggregate_id, event_type, payload FROM outbox_event ORDER BY id"
    )
    assert [e["aggregate_id"] for e in events] == [str(a["id"]) for a in alarms]
    assert {e["event_type"] for e in events} == {EventType.ALARM_CREATED}
    assert (
        await db.fetchval(
            "SELECT count(*) FROM ai_task WHERE attempt = 1 AND model_name = 'test-model'"
        )
        == 200
    )

    # The storm goes on: still violated, nothing new.
    again = await _batch(engine, db, [(d, _temp(2, 96.0)) for d in devices])
    assert again.created == []
    assert await db.fetchval("SELECT count(*) FROM alarm") == 200


async def test_runs_keep_message_order_open_close_reopen_in_one_batch(
    db: asyncpg.Connection,
) -> None:
    engine = _engine()
    batch = await _batch(
        engine,
        db,
        [
            ("door-1", _event(0, "DOOR_OPEN")),
            ("door-2", _event(0, "DOOR_OPEN")),
            ("door-1", _event(1, "DOOR_CLOSE")),  # clears the alarm created just before
            ("door-1", _event(2, "DOOR_OPEN")),  # a new one: supersedes the cleared one
            ("door-2", _event(1, "DOOR_OPEN")),  # the same (device, rule) twice in a run
        ],
    )
    assert len(batch.created) == 4
    assert batch.cleared == 1
    assert batch.superseded == 2
    rows = await db.fetch(
        "SELECT device_id, status, cleared_at IS NOT NULL AS cleared, superseded_by "
        "FROM alarm ORDER BY id"
    )
    statuses = [(r["device_id"], r["status"], r["cleared"]) for r in rows]
    assert statuses == [
        ("door-1", "SUPERSEDED", True),
        ("door-2", "SUPERSEDED", False),
        ("door-1", "NEW", False),
        ("door-2", "NEW", False),
    ]
    assert rows[0]["superseded_by"] == 3  # door-1's reopening
    assert rows[1]["superseded_by"] == 4


async def test_create_alarms_mixes_dedup_hits_held_keys_and_fresh_ones_in_order(
    db: asyncpg.Connection,
) -> None:
    now = await db.fetchval("SELECT now()")

    def request(device: str, event: str) -> AlarmRequest:
        return AlarmRequest(device_id=device, rule_key="door-open", severity="MAJOR",
                            telemetry_event_id=event * 64, reason="DOOR_OPEN")  # fmt: skip

    async with db.transaction():
        first = await create_alarm(
            db, device_id="held", rule_key="door-open", severity="MAJOR",
            telemetry_event_id="a" * 64, reason="DOOR_OPEN", node_id="n", now=now,
        )  # fmt: skip
        assert first.alarm is not None
        creations = await create_alarms(
            db,
            [request("fresh-1", "b"), request("held", "a"), request("fresh-2", "c")],
            node_id="n",
            now=now,
        )
    assert [c.created for c in creations] == [True, False, True]  # "held"/"a": a dedup hit
    async with db.transaction():
        (refire,) = await create_alarms(db, [request("held", "d")], node_id="n", now=now)
    assert refire.created
    assert refire.superseded_id == first.alarm.id
    with pytest.raises(ValueError, match="distinct active keys"):
        await create_alarms(db, [request("x", "e"), request("x", "f")], node_id="n", now=now)


async def test_two_nodes_racing_for_the_same_alarm_one_wins_the_other_retries(
    db_dsn: str,
) -> None:
    """Both see the key free; the loser's insert conflicts and asks for a batch retry."""
    conns = [await asyncpg.connect(db_dsn) for _ in range(2)]
    looked = asyncio.Barrier(2)
    try:
        now = await conns[0].fetchval("SELECT now()")

        async def attempt(conn: asyncpg.Connection, node: str) -> str:
            request = AlarmRequest(
                device_id="dev", rule_key="door-open", severity="MAJOR",
                telemetry_event_id=node[-1] * 64, reason="DOOR_OPEN",
            )  # fmt: skip
            try:
                async with conn.transaction():
                    await conn.fetchval("SELECT 1")
                    await looked.wait()
                    await create_alarms(conn, [request], node_id=node, now=now)
            except ConcurrentWriteError:
                return "retry"
            return "created"

        outcomes = await asyncio.gather(attempt(conns[0], "node-a"), attempt(conns[1], "node-b"))
    finally:
        for conn in conns:
            await conn.close()
    assert sorted(outcomes) == ["created", "retry"]


async def test_a_fleet_clearing_and_firing_in_one_batch_is_one_step_of_few_statements(
    db: asyncpg.Connection,
) -> None:
    """Hysteresis across a fleet: in one batch half the devices clear and the other half
    fire, interleaved. Each (device, rule) appears once, so the whole batch is one step: one
    statement per kind of write (not a run of firings cut by every clearing, two statements
    per clearing), with every alarm and event as one by one, in message order."""
    engine = _engine()
    devices = [f"dev-{n:03d}" for n in range(200)]
    hot, cool = devices[0::2], devices[1::2]
    await _batch(engine, db, [(d, _temp(0, 95.0 if d in hot else 20.0)) for d in devices])
    assert await db.fetchval("SELECT count(*) FROM alarm WHERE cleared_at IS NULL") == 100

    # asyncpg asks the server about a float8[] parameter once per connection (the clear's
    # receipts' ages, b5a5ee3): the first clearing batch of a pooled connection pays that
    # round trip once, no batch after it. Paid here, so that what is counted is a batch's.
    await db.fetchval("SELECT $1::float8[]", [0.0])
    batch, statements = await _counted(
        engine, db, [(d, _temp(1, 70.0 if d in hot else 90.0)) for d in devices]
    )

    assert batch.cleared == 100
    assert len(batch.created) == 100
    # lock states, the firings (taken keys, alarms, AI tasks, audits, events), the clearings
    # (alarms, events), states written back, BEGIN and COMMIT: 12. Before steps: 705.
    assert len(statements) <= 12, statements
    cleared = await db.fetch(
        "SELECT device_id, clear_event_id FROM alarm WHERE cleared_at IS NOT NULL ORDER BY id"
    )
    assert [(r["device_id"], r["clear_event_id"]) for r in cleared] == [
        (d, telemetry_event_id(d, _temp(1, 70.0))) for d in hot
    ]
    open_now = await db.fetch("SELECT device_id FROM alarm WHERE cleared_at IS NULL ORDER BY id")
    assert [r["device_id"] for r in open_now] == cool
    events = await db.fetch(
        "SELECT event_type, payload::jsonb->>'device_id' AS device FROM outbox_event "
        "WHERE event_type = $1 ORDER BY id",
        EventType.ALARM_CLEARED,
    )
    assert [e["device"] for e in events] == hot  # in message order

    # The next swing: the cleared alarms, still NEW, are superseded by their devices' new
    # ones (and the alarms of the others clear), again as one step.
    swing, statements = await _counted(
        engine, db, [(d, _temp(2, 95.0 if d in hot else 70.0)) for d in devices]
    )
    assert len(swing.created) == 100
    assert swing.superseded == 100
    assert swing.cleared == 100
    # As above, and the holders locked, superseded and linked, with their audits and events.
    assert len(statements) <= 17, statements
    rows = await db.fetch(
        "SELECT old.id, old.device_id, old.status, old.superseded_by, new.status AS new_status, "
        "new.telemetry_event_id AS new_event FROM alarm old JOIN alarm new "
        "ON new.id = old.superseded_by ORDER BY old.id"
    )
    assert [r["device_id"] for r in rows] == hot
    assert {(r["status"], r["new_status"]) for r in rows} == {("SUPERSEDED", "NEW")}
    assert [r["new_event"] for r in rows] == [telemetry_event_id(d, _temp(2, 95.0)) for d in hot]
    audits = await db.fetch(
        "SELECT a.device_id, u.from_status, u.to_status, u.event_id FROM alarm_audit u "
        "JOIN alarm a ON a.id = u.alarm_id WHERE u.action = 'supersede' ORDER BY u.id"
    )
    assert [(r["device_id"], r["from_status"], r["to_status"], r["event_id"]) for r in audits] == [
        (d, "NEW", "SUPERSEDED", telemetry_event_id(d, _temp(2, 95.0))) for d in hot
    ]
    superseded_events = await db.fetch(
        "SELECT payload::jsonb->'alarm'->>'device_id' AS device, "
        "payload::jsonb->'alarm'->>'status' AS status, payload::jsonb->>'from' AS was "
        "FROM outbox_event WHERE event_type = $1 ORDER BY id",
        EventType.ALARM_SUPERSEDED,
    )
    assert [(e["device"], e["status"], e["was"]) for e in superseded_events] == [
        (d, "SUPERSEDED", "NEW") for d in hot
    ]
    created = await db.fetch(
        "SELECT payload::jsonb->'alarm'->>'device_id' AS device, "
        "payload::jsonb->>'supersedes' AS old "
        "FROM outbox_event WHERE event_type = $1 ORDER BY id",
        EventType.ALARM_CREATED,
    )
    assert [(e["device"], e["old"]) for e in created[-100:]] == [
        (r["device_id"], str(r["id"])) for r in rows
    ]
