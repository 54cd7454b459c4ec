"""Retention measures age on the database's clock, the one that stamped every row it compares
(received_at, last_seen_at, published_at, finished_at, at ...), not on the node's.

A node whose wall clock jumped (a dead RTC, an NTP server gone wrong, a VM restored from a
snapshot) ran the pass with its own ``now``: a year ahead, it dropped every telemetry day and
pruned every dead letter, audit row and published event as if a year had gone by; a year
behind, it made partitions for last year and none for the days to come, so that ingest filled
the default partition. Real PostgreSQL; the node's clock is the injected one."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta

import asyncpg
import pytest

from gateway.config import RetentionConfig
from gateway.maintenance.runner import Maintenance, utc_day
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id
from storage.ingest import TelemetryRow, insert_telemetry

pytestmark = pytest.mark.synthetic_events


def sample(device: str, ts: datetime) -> TelemetryRow:
    message = Telemetry(ts=ts, seq=1, metrics={"temp": 21.0})
    return TelemetryRow(
        event_id=telemetry_event_id(device, message),
        device_id=device,
        ts_us=message.micros(),
        seq=1,
        metrics_json='{"temp": 21.0}',
        events_json=None,
    )


async def populate(conn: asyncpg.Connection) -> dict[str, int]:
    """Rows of today, each of a kind that a pass prunes once it is old enough."""
    now = datetime.now(UTC)
    async with conn.transaction():
        await insert_telemetry(conn, [sample("dev-1", now)], "n1")
    await conn.execute(
        "INSERT INTO dead_letter (topic, payload, payload_size, payload_sha256, reason, detail, "
        "node_id) VALUES ('t', 'x', 1, encode(sha256('x'), 'hex'), 'INVALID', 'bad', 'n1')"
    )
    alarm = await conn.fetchval(
        "INSERT INTO alarm (device_id, rule_key, severity, status, telemetry_event_id, "
        "dedup_key, triggered_at, handled_at, handled_by, closed_at, closed_by, node_id) "
        "VALUES ('d', 'hot', 'CRITICAL', 'CLOSED', 'e', 'hot:d:e', now(), now(), 'op', now(), "
        "'op', 'n1') RETURNING id"
    )
    await conn.execute(
        "INSERT INTO alarm_audit (alarm_id, actor, action, to_status, node_id) "
        "VALUES ($1, 'op', 'close', 'CLOSED', 'n1')",
        alarm,
    )
    await conn.execute(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, "
        "status, published_at) VALUES ($1, 'alarm', '1', 'alarm.created', '{}', 'PUBLISHED', "
        "now())",
        uuid.uuid4(),
    )
    return await counts(conn)


async def counts(conn: asyncpg.Connection) -> dict[str, int]:
    row = await conn.fetchrow(
        "SELECT (SELECT count(*) FROM telemetry) AS telemetry, "
        "(SELECT count(*) FROM dead_letter) AS dead_letter, "
        "(SELECT count(*) FROM alarm_audit) AS alarm_audit, "
        "(SELECT count(*) FROM outbox_event) AS outbox_event"
    )
    assert row is not None
    return dict(row.items())


def maintenance(pool: asyncpg.Pool, node_clock: datetime) -> Maintenance:
    """A node's pass as the daemon and the CLI make it, but for the node's wall clock."""
    return Maintenance(
        pool=pool,
        retention=RetentionConfig(
            telemetry_days=30,
            dead_letter_days=30,
            audit_days=30,
            outbox_days=7,
            partitions_ahead_days=2,
        ),
        metrics=Metrics(),
        clock=lambda: node_clock,
    )


async def test_a_node_clock_a_year_ahead_prunes_nothing_that_is_young(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    before = await populate(db)
    assert before == {"telemetry": 1, "dead_letter": 1, "alarm_audit": 1, "outbox_event": 1}

    report = await maintenance(pool, datetime.now(UTC) + timedelta(days=400)).run_once()

    assert report.ran
    assert report.dropped == []
    assert not any(report.deleted.values()), report.deleted
    assert await counts(db) == before


async def test_a_node_clock_a_year_behind_makes_the_partitions_of_the_days_to_come(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    today: date = await db.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    report = await maintenance(pool, datetime.now(UTC) - timedelta(days=400)).run_once()

    assert report.ran
    ahead = [today + timedelta(days=n) for n in range(3)]
    parts = {
        r["relname"]
        for r in await db.fetch(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'telemetry'::regclass"
        )
    }
    assert {f"telemetry_p{day:%Y%m%d}" for day in ahead} <= parts
    last_year = utc_day(datetime.now(UTC) - timedelta(days=400))
    assert f"telemetry_p{last_year:%Y%m%d}" not in parts
