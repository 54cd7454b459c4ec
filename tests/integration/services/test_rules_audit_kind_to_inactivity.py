"""A reload that makes a rule an inactivity rule under the same key (an event or a threshold
rule before): the device's next message ends a silence, and clears the inactivity alarms of
the device. It must not clear the alarm the rule raised under its old kind: an SOS a carer
is on, a boiler still at 95, are not over because the device was heard from."""

from __future__ import annotations

from datetime import timedelta

import asyncpg

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.alarms.inactivity import InactivityMonitor
from gateway.domain.rules import RuleConfig
from protocol import Telemetry
from tests.integration.services.test_alarms import _last_heard
from tests.integration.services.test_rules_audit_kind_change import _engine, _now
from tests.integration.services.test_rules_audit_kind_change import _store as _store_of

DEVICE = "pendant-1"
SILENT = RuleConfig(key="alert", kind="inactivity", silent_seconds=300, severity="MAJOR")


async def _store(engine: AlarmEngine, pool: asyncpg.Pool, message: Telemetry) -> BatchAlarms:
    return await _store_of(engine, pool, message, device=DEVICE)


async def _uncleared(pool: asyncpg.Pool) -> list[str]:
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT rule_key FROM alarm WHERE cleared_at IS NULL ORDER BY id")
    return [row["rule_key"] for row in rows]


async def test_an_event_rule_made_an_inactivity_rule_leaves_its_sos_alarm_standing(
    pool: asyncpg.Pool,
) -> None:
    now = await _now(pool)
    sos = RuleConfig(key="alert", kind="event", event="SOS", severity="CRITICAL")
    raised = await _store(_engine(sos), pool, Telemetry(ts=now, events=[{"type": "SOS"}]))
    assert len(raised.created) == 1
    reloaded = _engine(SILENT)
    heard = await _store(
        reloaded, pool, Telemetry(ts=now + timedelta(seconds=5), metrics={"batt": 80})
    )
    assert heard.cleared == 0, "the device's battery report cleared the SOS alarm"
    assert await _uncleared(pool) == ["alert"]


async def test_a_threshold_rule_made_an_inactivity_rule_leaves_its_alarm_standing(
    pool: asyncpg.Pool,
) -> None:
    now = await _now(pool)
    hot = RuleConfig(
        key="alert", kind="threshold", metric="temp", op=">", value=80, severity="MAJOR"
    )
    raised = await _store(_engine(hot), pool, Telemetry(ts=now, metrics={"temp": 95}))
    assert len(raised.created) == 1
    reloaded = _engine(SILENT)
    heard = await _store(
        reloaded, pool, Telemetry(ts=now + timedelta(seconds=5), metrics={"temp": 96})
    )
    assert heard.cleared == 0, "a sample still at 96 cleared the temp > 80 alarm"
    assert await _uncleared(pool) == ["alert"]


async def test_the_inactivity_alarm_of_the_rule_is_still_cleared_by_the_next_message(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    await _last_heard(db, {DEVICE: 3700})
    engine = _engine(SILENT)
    await InactivityMonitor(pool=pool, engine=engine, interval_s=1, hearing=None).run_once()
    assert await _uncleared(pool) == ["alert"]
    heard = await _store(engine, pool, Telemetry(ts=await _now(pool), metrics={"batt": 80}))
    assert heard.cleared == 1
    assert await _uncleared(pool) == []
