"""The rule check (`gateway rules check`, the daemon's rule watch) under device clocks that
lie: a fleet whose clocks restart at 1970 (no RTC) or run hours behind sends the rule's
metric all the time, and a device whose clock ran years ahead sent a name once, long ago.
The window is the telemetry stored in it (received), whatever the devices' clocks say."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
from structlog.testing import capture_logs

from gateway.alarms.rule_watch import RuleWatch, find_unseen
from gateway.config import parse_config
from gateway.domain.rule_check import watched_names
from gateway.domain.rules import RuleSet
from storage import alarms as repo

RULES = """
[[rules]]
key = "hot"
kind = "threshold"
severity = "MAJOR"
metric = "temp"
op = ">"
value = 30

[[rules]]
key = "door"
kind = "event"
severity = "MAJOR"
event = "DOOR_OPEN"

[[rules]]
key = "damp"
kind = "threshold"
severity = "WARNING"
metric = "humidty"
op = ">"
value = 80
"""


def _rules() -> RuleSet:
    return parse_config(RULES).rule_set()


async def _store(
    pool: asyncpg.Pool,
    device: str,
    ts: datetime,
    *,
    received_at: datetime | None = None,
    metrics: str | None = None,
    events: str | None = None,
) -> None:
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO telemetry (event_id, device_id, ts, metrics, events, node_id, received_at)"
            " VALUES (encode(sha256(gen_random_uuid()::text::bytea), 'hex'), $1, $2, $3::jsonb,"
            " $4::jsonb, 'n1', coalesce($5, now()))",
            device,
            ts,
            metrics,
            events,
            received_at,
        )


async def _db_now(pool: asyncpg.Pool) -> datetime:
    async with pool.acquire() as conn:
        return (await repo.db_now(conn)).astimezone(UTC)


async def _fleet_with_lying_clocks(pool: asyncpg.Pool, now: datetime) -> None:
    # Received now: a pendant whose clock restarted at 1970, a sensor 3 hours behind.
    await _store(
        pool, "pendant-1", datetime(1970, 1, 1, 0, 5, tzinfo=UTC), events='[{"type": "DOOR_OPEN"}]'
    )
    await _store(pool, "sensor-1", now - timedelta(hours=3), metrics='{"temp": 21.5}')
    # Received two days ago, dated years ahead: the misspelled name, sent once.
    await _store(
        pool, "sensor-2", now + timedelta(days=5 * 365), received_at=now - timedelta(days=2),
        metrics='{"humidty": 50}',
    )  # fmt: skip


async def test_the_check_counts_what_was_received_in_the_window_whatever_the_clocks(
    pool: asyncpg.Pool,
) -> None:
    now = await _db_now(pool)
    await _fleet_with_lying_clocks(pool, now)
    async with pool.acquire() as conn:
        found = await find_unseen(conn, watched_names(_rules()), now - timedelta(hours=1))
    assert sorted(report.rule_key for report in found) == ["damp"], [r.describe() for r in found]


async def test_the_watch_warns_of_no_rule_that_the_fleet_matches_under_clocks_behind(
    pool: asyncpg.Pool,
) -> None:
    now = await _db_now(pool)
    times = iter([now - timedelta(seconds=61), now])

    async def clock(_conn: asyncpg.Connection) -> datetime:
        return next(times)

    watch = RuleWatch(pool=pool, rules=_rules, after_s=60, clock=clock)
    assert await watch.run_once() == []  # the rules loaded a minute ago
    await _fleet_with_lying_clocks(pool, now)
    with capture_logs() as logs:
        reports = await watch.run_once()
    warned = sorted(e["rule"] for e in logs if e["event"] == "rule_never_matched")
    assert warned == ["damp"], [r.describe() for r in reports]
