"""Retention of the other tables: each pruned past its setting, live rows kept whatever their
age; and several nodes' maintenance passes at once, of which one does the work."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from gateway.config import RetentionConfig
from gateway.maintenance.runner import Maintenance, PassReport
from gateway.support.metrics import Metrics
from storage import console
from storage.maintenance import MAINTENANCE_LOCK_KEY
from storage.pool import create_pool
from tests.support.waiting import wait_until

# Placeholder outbox rows ("{}" payloads) stand in for real ones: they are pruned, not read.
pytestmark = pytest.mark.synthetic_events

NOW = datetime.now(UTC)
DAYS = {
    "dead_letter_days": 10,
    "audit_days": 20,
    "receipts_days": 30,
    "outbox_days": 40,
    "outbox_dead_days": 45,
    "ai_payload_days": 50,
    "notify_days": 60,
}


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def runner(
    pool: asyncpg.Pool,
    clock: Clock,
    *,
    metrics: Metrics | None = None,
    on_locked: asyncio.Event | None = None,
    **days: int,
) -> Maintenance:
    async def hold() -> None:
        assert on_locked is not None
        await on_locked.wait()

    return Maintenance(
        pool=pool,
        retention=RetentionConfig(**{**DAYS, **days}),  # type: ignore[arg-type]  # test keywords
        metrics=metrics or Metrics(),
        db_clock=clock,
        chunk_rows=4,  # several chunks per table
        on_locked=hold if on_locked is not None else None,
    )


async def populate(conn: asyncpg.Connection, copies: int = 1) -> dict[str, int]:
    """Rows of every pruned kind, live and finished, ``copies`` times; all made now."""
    for n in range(copies):
        await conn.execute(
            """
            INSERT INTO dead_letter (topic, payload, payload_size, payload_sha256, reason,
                                     detail, node_id)
            VALUES ('iot/devices/d/telemetry', 'x', 1, encode(sha256($1::bytea), 'hex'),
                    'INVALID', 'bad', 'n1')
            """,
            f"letter-{n}".encode(),
        )
        open_alarm = await conn.fetchval(
            """
            INSERT INTO alarm (device_id, rule_key, severity, telemetry_event_id, dedup_key,
                               active_key, triggered_at, node_id)
            VALUES ($1, 'hot', 'CRITICAL', 'e', 'hot:' || $1 || ':e', $1 || ':hot', now(), 'n1')
            RETURNING id
            """,
            f"open-{n}",
        )
        closed_alarm = await conn.fetchval(
            """
            INSERT INTO alarm (device_id, rule_key, severity, status, telemetry_event_id,
                               dedup_key, triggered_at, handled_at, handled_by, closed_at,
                               closed_by, node_id)
            VALUES ($1, 'hot', 'CRITICAL', 'CLOSED', 'e', 'hot:' || $1 || ':e', now(), now(),
                    'op', now(), 'op', 'n1')
            RETURNING id
            """,
            f"closed-{n}",
        )
        for alarm in (open_alarm, closed_alarm):
            await conn.execute(
                "INSERT INTO alarm_audit (alarm_id, actor, action, to_status, node_id) "
                "VALUES ($1, 'system:rules', 'create', 'NEW', 'n1'), "
                "($1, 'op', 'confirm', 'CONFIRMED', 'n1')",
                alarm,
            )
        await conn.execute(
            "INSERT INTO dead_letter_audit (dead_letter_id, action, actor, topic, reason, "
            "payload_size, payload_sha256, replay_count, node_id) "
            "VALUES ($1, 'discard', 'root', 't', 'MALFORMED', 1, 'ab', 0, 'n1')",
            1000 + n,
        )
        open_command = await conn.fetchval(
            "INSERT INTO command (device_id, name) VALUES ('d', 'reboot') RETURNING id"
        )
        done_command = await conn.fetchval(
            "INSERT INTO command (device_id, name, status, finished_at) "
            "VALUES ('d', 'reboot', 'CANCELLED', now()) RETURNING id"
        )
        for command, reason in ((open_command, "NOT_CLAIMED"), (done_command, "COMMAND_CLOSED")):
            await conn.execute(
                "INSERT INTO command_audit (command_id, actor, action, to_status, "
                "claim_generation, node_id) VALUES ($1, 'api', 'create', 'PENDING', 0, 'n1')",
                command,
            )
            await conn.execute(
                "INSERT INTO command_receipt (command_id, reported_command_id, device_id, "
                "result, outcome, reason, received_by) "
                "VALUES ($1, $1, 'd', 'ACKED', 'rejected', $2, 'n1')",
                command,
                reason,
            )
        await conn.execute(
            "INSERT INTO command_receipt (reported_command_id, device_id, result, outcome, "
            "reason, received_by) VALUES (999999, 'd', 'ACKED', 'rejected', 'UNKNOWN_COMMAND', "
            "'n1')"
        )
        for status, published in (("PENDING", None), ("PUBLISHED", NOW)):
            await conn.execute(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, "
                "payload, status, published_at) VALUES ($1, 'alarm', '1', 'alarm.created', "
                "'{}', $2, $3)",
                uuid.uuid4(),
                status,
                published,
            )
        await conn.execute(
            "INSERT INTO consumed_event (consumer, event_id) VALUES ('push', $1)", uuid.uuid4()
        )
        silence = await conn.fetchval(
            "INSERT INTO notify_silence (matchers, ends_at, created_by) "
            "VALUES ('{}', now(), 'ops') RETURNING id"
        )
        for status in ("PENDING", "SENDING", "SENT", "FAILED", "SILENCED"):
            ended = status in ("SENT", "FAILED", "SILENCED")
            await conn.execute(
                "INSERT INTO notify_delivery (event_id, outbox_id, event, receiver, body, status,"
                " lease_owner, lease_until, last_error, silence_id, event_created_at,"
                " finished_at) VALUES ($1, 1, 'alarm.created', 'hook', '{}', $2, $3, $4, $5,"
                " $6, now(), $7)",
                uuid.uuid4(), status,
                "n1" if status == "SENDING" else None,
                NOW if status == "SENDING" else None,
                "refused" if status == "FAILED" else None,
                silence if status == "SILENCED" else None,
                NOW if ended else None,
            )  # fmt: skip
        await conn.execute(
            """
            INSERT INTO ai_task (alarm_id, attempt, status, model_name, prompt_version,
                                 request_payload, claim_token, claimed_by, started_at)
            VALUES ($1, 1, 'PROCESSING', 'm', 'v1', '{"q": 1}', gen_random_uuid(), 'w', now())
            """,
            open_alarm,
        )
        await conn.execute(
            """
            INSERT INTO ai_task (alarm_id, attempt, status, model_name, prompt_version,
                                 request_payload, raw_response, summary, possible_cause,
                                 inspection_suggestion, risk_level, confidence, started_at,
                                 finished_at)
            VALUES ($1, 1, 'SUCCEEDED', 'm', 'v1', '{"q": 1}', '{"a": 1}', 'hot', 'sun', 'look',
                    'LOW', 0.5, now(), now())
            """,
            closed_alarm,
        )
        await conn.execute(
            """
            INSERT INTO ai_task (alarm_id, attempt, status, model_name, prompt_version,
                                 request_payload, raw_response, error_code, error_message,
                                 started_at, finished_at)
            VALUES ($1, 2, 'FAILED', 'm', 'v1', '{"q": 1}', 'not json', 'LLM_OUTPUT_INVALID',
                    'bad', now(), now())
            """,
            closed_alarm,
        )
    return await counts(conn)


async def counts(conn: asyncpg.Connection) -> dict[str, int]:
    row = await conn.fetchrow(
        """
        SELECT (SELECT count(*) FROM dead_letter) AS dead_letter,
               (SELECT count(*) FROM alarm_audit) AS alarm_audit,
               (SELECT count(*) FROM command_audit) AS command_audit,
               (SELECT count(*) FROM dead_letter_audit) AS dead_letter_audit,
               (SELECT count(*) FROM command_receipt) AS command_receipt,
               (SELECT count(*) FROM outbox_event) AS outbox_event,
               (SELECT count(*) FROM consumed_event) AS consumed_event,
               (SELECT count(*) FROM notify_delivery) AS notify_delivery,
               (SELECT count(*) FROM ai_task WHERE request_payload IS NOT NULL) AS ai_payloads,
               (SELECT count(*) FROM ai_task) AS ai_task,
               (SELECT count(*) FROM alarm) AS alarm,
               (SELECT count(*) FROM command) AS command
        """
    )
    assert row is not None
    return dict(row.items())


async def test_each_table_is_pruned_past_its_setting_and_live_rows_stay(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    before = await populate(db, copies=5)
    clock = Clock(NOW + timedelta(days=9))  # younger than every setting: nothing goes
    report = await runner(pool, clock).run_once()
    assert not any(report.deleted.values()), report.deleted
    assert await counts(db) == before

    # Past each setting in turn: that table goes, the others stay.
    expected = dict(before)
    steps = [
        (11, {"dead_letter": 0}),
        # The open alarm's and command's; discards have no live state: all go.
        (21, {"alarm_audit": 10, "command_audit": 5, "dead_letter_audit": 0}),
        (31, {"command_receipt": 5}),  # the open command's
        (41, {"outbox_event": 5, "consumed_event": 0}),  # the PENDING ones
        (51, {"ai_payloads": 5}),  # the PROCESSING task's
        (61, {"notify_delivery": 10}),  # the PENDING and SENDING ones
    ]
    for days, after in steps:
        clock.now = NOW + timedelta(days=days)
        report = await runner(pool, clock).run_once()
        assert report.ran
        expected.update(after)
        assert await counts(db) == expected, f"after {days} days"

    # The live rows that stayed are the live ones.
    assert await db.fetchval(
        "SELECT bool_and(a.status = 'NEW') FROM alarm_audit au JOIN alarm a ON a.id = au.alarm_id"
    )
    assert await db.fetchval(
        "SELECT bool_and(c.status = 'PENDING') FROM command_receipt r "
        "JOIN command c ON c.id = r.command_id"
    )
    assert await db.fetchval("SELECT bool_and(status = 'PENDING') FROM outbox_event")
    assert await db.fetchval(
        "SELECT bool_and(status IN ('PENDING', 'SENDING')) FROM notify_delivery"
    )
    pruned = await db.fetch(
        "SELECT status, summary, error_code, payload_pruned_at FROM ai_task "
        "WHERE request_payload IS NULL AND raw_response IS NULL ORDER BY id"
    )
    assert {(r["status"], r["summary"], r["error_code"]) for r in pruned} == {
        ("SUCCEEDED", "hot", None),
        ("FAILED", None, "LLM_OUTPUT_INVALID"),
    }
    assert all(r["payload_pruned_at"] == NOW + timedelta(days=51) for r in pruned)  # its step
    # Nothing but payloads leaves ai_task, and no alarm or command goes.
    assert (expected["ai_task"], expected["alarm"], expected["command"]) == (
        before["ai_task"],
        before["alarm"],
        before["command"],
    )


async def test_zero_keeps_forever(pool: asyncpg.Pool, db: asyncpg.Connection) -> None:
    before = await populate(db)
    forever = dict.fromkeys([*DAYS, "telemetry_days"], 0)
    report = await runner(pool, Clock(NOW + timedelta(days=10_000)), **forever).run_once()
    assert report.deleted == {}
    assert await counts(db) == before


async def test_a_dead_letter_seen_again_is_kept(pool: asyncpg.Pool, db: asyncpg.Connection) -> None:
    await populate(db)
    await db.execute("UPDATE dead_letter SET last_seen_at = now() + interval '5 days'")
    await runner(pool, Clock(NOW + timedelta(days=11))).run_once()
    assert await db.fetchval("SELECT count(*) FROM dead_letter") == 1
    await runner(pool, Clock(NOW + timedelta(days=16))).run_once()
    assert await db.fetchval("SELECT count(*) FROM dead_letter") == 0


@pytest.fixture
async def pools(db_dsn: str) -> AsyncIterator[list[asyncpg.Pool]]:
    """Three nodes' pools on the same database."""
    made = [
        await create_pool(db_dsn, min_size=1, max_size=2, application_name=f"node-{n}")
        for n in range(3)
    ]
    try:
        yield made
    finally:
        for p in made:
            await p.close()


async def test_one_node_does_the_pass_while_another_holds_the_lock(
    pools: list[asyncpg.Pool], db: asyncpg.Connection
) -> None:
    before = await populate(db, copies=3)
    clock = Clock(NOW + timedelta(days=100))
    release = asyncio.Event()
    holder = runner(pools[0], clock, on_locked=release)
    first = asyncio.create_task(holder.run_once())
    # The first pass holds the lock (and is parked right after taking it) ...
    await wait_for_lock_holder(db)
    # ... so the other nodes skip, and change nothing.
    skipped = await asyncio.gather(*(runner(p, clock).run_once() for p in pools[1:]))
    assert skipped == [PassReport(ran=False), PassReport(ran=False)]
    assert await counts(db) == before
    release.set()
    done = await first
    assert done.ran
    assert done.deleted["dead_letter"] == 3
    # Released: the next pass anywhere runs, finds nothing left.
    again = await runner(pools[1], clock).run_once()
    assert again.ran
    assert not any(again.deleted.values())


async def test_passes_released_at_once_delete_each_row_once(
    pools: list[asyncpg.Pool], db: asyncpg.Connection
) -> None:
    before = await populate(db, copies=8)
    clock = Clock(NOW + timedelta(days=100))
    runners = [runner(p, clock) for p in pools]
    start = asyncio.Barrier(len(runners) + 1)

    async def go(r: Maintenance) -> PassReport:
        await start.wait()
        return await r.run_once()

    tasks = [asyncio.create_task(go(r)) for r in runners]
    await start.wait()
    reports = await asyncio.gather(*tasks)  # no errors

    deleted: dict[str, int] = {}
    for report in reports:
        for table, n in report.deleted.items():
            deleted[table] = deleted.get(table, 0) + n
    after = await counts(db)
    assert deleted["dead_letter"] == before["dead_letter"] == 8
    for table in ("alarm_audit", "command_audit", "command_receipt", "outbox_event"):
        assert deleted[table] == before[table] - after[table], table
    assert deleted["ai_task_payloads"] == before["ai_payloads"] - after["ai_payloads"] == 16
    assert sum(r.ran for r in reports) >= 1


async def wait_for_lock_holder(db: asyncpg.Connection) -> None:
    """Until a session holds the maintenance advisory lock in this test's database (advisory
    locks are per database; pg_locks shows the cluster's, other tests' passes included)."""
    key = MAINTENANCE_LOCK_KEY

    async def held() -> bool:
        return bool(
            await db.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND ((classid::bigint << 32) | objid::bigint) = $1",
                key,
            )
        )

    await wait_until(held, timeout=10, message="a pass holds the maintenance lock")


async def test_expired_stream_tickets_are_deleted_and_valid_ones_stay(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """Not a retention setting: a ticket that expired (used or not) is of no use to any node,
    whatever the days kept; one still valid is left for its client."""
    for n in range(9):  # several chunks (4 rows each)
        await console.insert_ticket(
            db, digest=bytes([n]) * 32, token_name="wall", role="viewer", lifetime_s=-1
        )
    await console.insert_ticket(
        db, digest=b"v" * 32, token_name="wall", role="viewer", lifetime_s=60
    )
    forever = dict.fromkeys([*DAYS, "telemetry_days"], 0)
    report = await runner(pool, Clock(NOW), **forever).run_once()
    assert report.deleted == {"stream_ticket": 9}
    assert await db.fetchval("SELECT count(*) FROM stream_ticket") == 1
    assert await console.use_ticket(db, b"v" * 32) == ("wall", "viewer")


async def test_a_notification_group_goes_once_its_windows_deliveries_are_pruned(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """Two groups with a window each, one sent long ago, one still to be sent: after
    notify_days the sent window is pruned, then its group; the other stays, with its window."""
    groups = {}
    for key, status in (("routes[0]{rule=done}", "SENT"), ("routes[0]{rule=open}", "PENDING")):
        group_id = await db.fetchval(
            "INSERT INTO notify_group (receiver, group_key, labels) VALUES ('hook', $1, '{}') "
            "RETURNING id",
            key,
        )
        delivery_id = await db.fetchval(
            "INSERT INTO notify_delivery (event_id, outbox_id, event, receiver, body, status,"
            " event_created_at, finished_at, group_id) VALUES ($1, 1, 'notify.group', 'hook',"
            " '{}', $2, now(), $3, $4) RETURNING id",
            uuid.uuid4(), status, NOW if status == "SENT" else None, group_id,
        )  # fmt: skip
        await db.execute(
            "UPDATE notify_group SET windows = 1, window_delivery_id = $2, window_due_at = now()"
            " WHERE id = $1",
            group_id,
            delivery_id,
        )
        groups[status] = group_id
    clock = Clock(NOW + timedelta(days=10))
    report = await runner(pool, clock).run_once()
    assert report.deleted.get("notify_group") == 0  # its window is still there
    clock.now = NOW + timedelta(days=DAYS["notify_days"] + 1)
    report = await runner(pool, clock).run_once()
    assert report.deleted["notify_group"] == 1
    left = await db.fetch("SELECT id FROM notify_group")
    assert [r["id"] for r in left] == [groups["PENDING"]]
    assert await db.fetchval("SELECT count(*) FROM notify_delivery") == 1
