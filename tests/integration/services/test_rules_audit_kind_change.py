"""A reload that changes a rule's kind under the same key (an event rule made a threshold
rule): the new rule must fire on the device's violation. The event rule left its row
"firing" (an occurrence with no clear event: a leak sensor that never sends
WATER_LEAK_CLEAR), and a threshold rule read that as its own violation going on. Reloads are
a new engine of the same node, as in test_hold_timer; the hold timer's pass runs once."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import asyncpg

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.alarms.holds import HoldTimer
from gateway.alarms.lifecycle import transition
from gateway.domain.alarm import Action
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id
from storage import alarms as repo
from storage import ingest as ingest_repo

DEVICE = "tank-1"
AS_EVENT = RuleConfig(key="leak", kind="event", event="WATER_LEAK", severity="MAJOR")
AS_THRESHOLD = RuleConfig(
    key="leak", kind="threshold", metric="water_mm", op=">", value=5, clear_value=2,
    severity="MAJOR",
)  # fmt: skip


def _engine(config: RuleConfig) -> AlarmEngine:
    return AlarmEngine(rules=compile_rules([config]), node_id="node-a", metrics=Metrics())


async def _store(
    engine: AlarmEngine, pool: asyncpg.Pool, message: Telemetry, *, device: str = DEVICE
) -> BatchAlarms:
    """``message`` of ``device`` stored and judged by ``engine``, in one transaction."""
    event_id = telemetry_event_id(device, message)
    stored = ingest_repo.TelemetryRow(
        event_id,
        device,
        message.micros(),
        message.seq,
        json.dumps(message.metrics) if message.metrics else None,
        json.dumps(message.events) if message.events else None,
    )
    async with pool.acquire() as conn, conn.transaction():
        await ingest_repo.insert_telemetry(conn, [stored], engine.node_id)
        batch = await engine.on_stored(conn, [(device, event_id, message)])
    engine.committed(batch)
    return batch


async def _now(pool: asyncpg.Pool) -> datetime:
    async with pool.acquire() as conn:
        return (await repo.db_now(conn)).astimezone(UTC)


async def _leak_alarm_closed(pool: asyncpg.Pool, at: datetime) -> None:
    """The event rule raised its alarm, and people dealt with it (no clear event came)."""
    raised = await _store(
        _engine(AS_EVENT), pool, Telemetry(ts=at, events=[{"type": "WATER_LEAK"}])
    )
    ((_, alarm_id),) = raised.created
    async with pool.acquire() as conn:
        for action in (Action.CONFIRM, Action.HANDLE, Action.CLOSE):
            async with conn.transaction():
                await transition(conn, alarm_id, action, actor="op:plumber", node_id="api")


async def _open_threshold_alarms(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    async with pool.acquire() as conn:
        return await conn.fetch(
            "SELECT id, status, trigger::text AS trigger FROM alarm "
            "WHERE rule_key = 'leak' AND cleared_at IS NULL "
            "AND status NOT IN ('CLOSED', 'FALSE', 'SUPERSEDED') AND trigger ? 'metric'"
        )


async def test_a_rule_made_a_threshold_rule_fires_on_the_next_violating_sample(
    pool: asyncpg.Pool,
) -> None:
    now = await _now(pool)
    await _leak_alarm_closed(pool, now - timedelta(seconds=60))
    reloaded = _engine(AS_THRESHOLD)
    hot = await _store(reloaded, pool, Telemetry(ts=now, metrics={"water_mm": 9}))
    assert len(hot.created) == 1, (
        f"the threshold rule raised {hot.created} on water_mm 9 > 5 after the reload"
    )
    (alarm,) = await _open_threshold_alarms(pool)
    assert json.loads(alarm["trigger"])["value"] == 9


async def test_a_rule_made_a_threshold_rule_fires_on_a_device_already_violating(
    pool: asyncpg.Pool,
) -> None:
    """The device reports by exception: its 9 mm was stored before the reload (no rule
    judged it), and the hold timer judges the row again under the new definition."""
    now = await _now(pool)
    await _leak_alarm_closed(pool, now - timedelta(seconds=60))
    await _store(_engine(AS_EVENT), pool, Telemetry(ts=now, metrics={"water_mm": 9}))
    reloaded = _engine(AS_THRESHOLD)
    timer = HoldTimer(pool=pool, engine=reloaded, clock=repo.db_now)
    raised = await timer.run_once()
    assert len(raised) == 1, f"the hold timer's judgement after the reload raised {raised}"
    assert len(await _open_threshold_alarms(pool)) == 1


async def test_a_rule_made_a_threshold_rule_again_fires_after_an_occurrence_between(
    pool: asyncpg.Pool,
) -> None:
    """Threshold, then event, then threshold again: the violation the first threshold rule
    noted stands for no alarm once an occurrence raised the rule's latest."""
    now = await _now(pool)
    first = await _store(
        _engine(AS_THRESHOLD),
        pool,
        Telemetry(ts=now - timedelta(seconds=90), metrics={"water_mm": 9}),
    )
    assert len(first.created) == 1
    await _leak_alarm_closed(pool, now - timedelta(seconds=60))
    again = await _store(_engine(AS_THRESHOLD), pool, Telemetry(ts=now, metrics={"water_mm": 8}))
    assert len(again.created) == 1, f"the threshold rule raised {again.created} on water_mm 8"


AS_SOS = RuleConfig(key="leak", kind="event", event="SOS", severity="CRITICAL")


async def test_a_threshold_rule_made_an_event_rule_clears_none_but_its_own_alarms(
    pool: asyncpg.Pool,
) -> None:
    """Clears pair strictly by type: the threshold's alarm (water_mm 9 > 5), still open when
    a reload made the key an SOS rule, is not the SOS_CLEAR's to clear."""
    now = await _now(pool)
    hot = await _store(
        _engine(AS_THRESHOLD),
        pool,
        Telemetry(ts=now - timedelta(seconds=60), metrics={"water_mm": 9}),
    )
    assert len(hot.created) == 1
    sos = _engine(AS_SOS)
    cancel = await _store(sos, pool, Telemetry(ts=now, events=[{"type": "SOS_CLEAR"}]))
    assert cancel.cleared == 0, "an SOS_CLEAR cleared the water_mm > 5 alarm"
    assert len(await _open_threshold_alarms(pool)) == 1
    # The SOS rule's own alarm, and its own clear, as ever.
    raised = await _store(
        sos, pool, Telemetry(ts=now + timedelta(seconds=5), events=[{"type": "SOS"}])
    )
    assert len(raised.created) == 1
    ended = await _store(
        sos, pool, Telemetry(ts=now + timedelta(seconds=9), events=[{"type": "SOS_CLEAR"}])
    )
    assert ended.cleared == 1
