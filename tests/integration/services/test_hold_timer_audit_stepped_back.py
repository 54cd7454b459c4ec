"""A `for_seconds` hold on a device whose clock ran ahead (within `max_future_skew_s`) and
was then stepped back by NTP while its seq went on counting: its samples are judged at the
newest time already judged (`stepped_back`) until its clock passes that time again. The hold
used to make no progress meanwhile (each sample judged at the same time, and each write
moving the timer's due time on), so a violation fired only once the device's time passed the
earlier, ahead one: up to `max_future_skew_s` late. Now the device's own clock, trusted again
since the step, measures the hold between such samples. Two nodes share one database and take
turns on the device's samples; each timer pass is run once with an injected clock (the
database's, shifted), no sleeps.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import asyncpg

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.alarms.holds import HoldTimer
from gateway.domain.rules import DeviceClock, RuleConfig, compile_rules
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id
from storage import alarms as repo
from storage import ingest as ingest_repo

DEVICE = "boiler-1"
AHEAD = timedelta(seconds=240)  # inside max_future_skew_s (300)
HELD = RuleConfig(
    key="temp-held", kind="threshold", metric="temp", op=">", value=80, clear_value=75,
    for_seconds=60, severity="CRITICAL",
)  # fmt: skip


def _node(node_id: str) -> AlarmEngine:
    return AlarmEngine(
        rules=compile_rules([HELD]), node_id=node_id, metrics=Metrics(), clock=DeviceClock()
    )


def _temp(ts: datetime, seq: int, value: float) -> Telemetry:
    return Telemetry(ts=ts, seq=seq, metrics={"temp": value})


async def _store(engine: AlarmEngine, pool: asyncpg.Pool, message: Telemetry) -> BatchAlarms:
    """One ingest transaction with one message, committed, as the daemon's writer."""
    event_id = telemetry_event_id(DEVICE, message)
    stored = ingest_repo.TelemetryRow(
        event_id, DEVICE, message.micros(), message.seq, json.dumps(message.metrics), None
    )
    async with pool.acquire() as conn, conn.transaction():
        await ingest_repo.insert_telemetry(conn, [stored], engine.node_id)
        batch = await engine.on_stored(conn, [(DEVICE, event_id, message)])
    engine.committed(batch)
    return batch


async def _now(pool: asyncpg.Pool) -> datetime:
    async with pool.acquire() as conn:
        return (await repo.db_now(conn)).astimezone(UTC)


async def _alarms(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    async with pool.acquire() as conn:
        return await conn.fetch("SELECT id, rule_key, cleared_at FROM alarm ORDER BY id")


def _timer(pool: asyncpg.Pool, engine: AlarmEngine, after_s: float) -> HoldTimer:
    """A timer whose pass runs `after_s` seconds of database time from now."""

    async def clock(conn: asyncpg.Connection) -> datetime:
        return await repo.db_now(conn) + timedelta(seconds=after_s)

    return HoldTimer(pool=pool, engine=engine, clock=clock)


async def _stepped_back(pool: asyncpg.Pool, nodes: tuple[AlarmEngine, AlarmEngine]) -> datetime:
    """The device reports 70 with its clock 4 minutes ahead (seq 10), then NTP steps it
    back to the right time; what the newest sample was judged at."""
    now = await _now(pool)
    batch = await _store(nodes[0], pool, _temp(now + AHEAD, 10, 70.0))
    assert batch.clock_adjustments == {}  # within the bounds: judged at its own time
    return now


async def test_a_violation_held_for_seconds_by_the_stepped_back_clock_fires_then(
    pool: asyncpg.Pool,
) -> None:
    nodes = (_node("node-a"), _node("node-b"))
    now = await _stepped_back(pool, nodes)
    # Every 10 s by its (right) clock, 95 from now on: held 60 s at the seventh sample.
    created: list[int] = []
    for n in range(7):
        batch = await _store(
            nodes[n % 2], pool, _temp(now + timedelta(seconds=10 * n), 11 + n, 95.0)
        )
        assert batch.clock_adjustments == {"stepped_back": 1}
        if n < 6:
            assert batch.created == [], n  # held 10 * n s of 60
        created.extend(alarm_id for _, alarm_id in batch.created)
    assert len(created) == 1, "held 60 s by the device's clock and not fired"
    (alarm,) = await _alarms(pool)
    assert (alarm["rule_key"], alarm["cleared_at"]) == ("temp-held", None)


async def test_the_hold_timer_counts_the_time_the_stepped_back_samples_held(
    pool: asyncpg.Pool,
) -> None:
    nodes = (_node("node-a"), _node("node-b"))
    now = await _stepped_back(pool, nodes)
    # Held 30 s by the device's clock (4 samples), then it falls silent while at 95.
    for n in range(4):
        await _store(nodes[n % 2], pool, _temp(now + timedelta(seconds=10 * n), 11 + n, 95.0))
    assert await _timer(pool, nodes[1], 20).run_once() == []  # 50 s of 60
    (alarm_id,) = await _timer(pool, nodes[0], 31).run_once()
    assert [a["id"] for a in await _alarms(pool)] == [alarm_id]
    # Fired once: later passes of either node find it firing.
    assert await _timer(pool, nodes[1], 600).run_once() == []
