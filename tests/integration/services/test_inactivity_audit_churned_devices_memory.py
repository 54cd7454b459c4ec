"""A fleet that churns device ids (replaced hardware, ids with a boot counter, a publisher
writing random ids) leaves device rows that never speak again. An inactivity rule on some of
the devices (`meter-*`): every pass read every silent device the rule has not alarmed, those
its selector leaves out included (they never are alarmed), all at once. With 50,000 such ids
a pass held ~19 MB at its peak, and it grows with every id the fleet ever used, on hosts that
promise a gateway under 100 MB. A pass now reads them page by page."""

from __future__ import annotations

import tracemalloc

import asyncpg

from gateway.alarms.engine import AlarmEngine
from gateway.alarms.inactivity import InactivityMonitor
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.support.metrics import Metrics
from storage import alarms as alarms_repo

RULE = RuleConfig(
    key="meter-silent", kind="inactivity", severity="WARNING", devices="meter-*", silent_seconds=300
)
CHURNED = 50_000


async def _silent(db: asyncpg.Connection, ids: list[str], seconds_ago: float) -> None:
    await db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) "
        "SELECT id, now() - interval '1 day', now() - make_interval(secs => $2) "
        "FROM unnest($1::text[]) AS id",
        ids,
        seconds_ago,
    )


async def test_a_pass_holds_a_page_of_silent_devices_not_all(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    await _silent(db, [f"sensor-{n:06d}-{n * 7919 % 100003:05d}" for n in range(CHURNED)], 3600)
    await _silent(db, ["meter-1", "meter-2", "zz-meter-3"], 3600)
    await _silent(db, ["meter-9"], 10)  # heard lately
    engine = AlarmEngine(rules=compile_rules([RULE]), node_id="node-a", metrics=Metrics())
    monitor = InactivityMonitor(pool=pool, engine=engine, interval_s=1)

    tracemalloc.start()
    try:
        raised = await monitor.run_once()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    alarmed = await db.fetch("SELECT device_id, rule_key FROM alarm ORDER BY device_id")
    assert [(r["device_id"], r["rule_key"]) for r in alarmed] == [
        ("meter-1", "meter-silent"),
        ("meter-2", "meter-silent"),
    ]
    assert len(raised) == 2
    # A page of rows (alarms_repo.SILENT_PAGE) at ~0.4 KB each, with room: not every churned id.
    assert peak < 4_000_000, peak

    # Paged or not, the next pass raises nothing again; a device silent in a later page is
    # found (the pages go by device id: "zz-..." comes after every "sensor-...").
    await _silent(db, ["zz-meter-4"], 3600)
    both = RuleConfig(
        key="meter-silent",
        kind="inactivity",
        severity="WARNING",
        devices=["meter-*", "zz-meter-*"],
        silent_seconds=300,
    )
    engine = AlarmEngine(rules=compile_rules([both]), node_id="node-a", metrics=Metrics())
    monitor = InactivityMonitor(pool=pool, engine=engine, interval_s=1)
    assert alarms_repo.SILENT_PAGE < CHURNED
    assert len(await monitor.run_once()) == 2
    alarmed = await db.fetch("SELECT device_id FROM alarm ORDER BY device_id")
    assert [r["device_id"] for r in alarmed] == ["meter-1", "meter-2", "zz-meter-3", "zz-meter-4"]
