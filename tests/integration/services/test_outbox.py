"""The outbox table's claims: per-aggregate order, leases, backoff, idempotent consumers."""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiomqtt
import asyncpg
import pytest

from gateway.alarms.engine import AlarmEngine
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.outbox import publisher as publisher_module
from gateway.outbox.publisher import OutboxPublisher
from gateway.support.broker_link import BrokerLink, SessionDown
from gateway.support.metrics import Metrics
from protocol import Telemetry, Topics
from protocol.events import EventType
from storage import outbox
from tests.support.plans import plan_nodes

T0 = 1_767_225_600_000
STORM_RULES = compile_rules(
    [RuleConfig(key="temp-high", kind="threshold", metric="temp", op=">", value=80,
                severity="CRITICAL")]
)  # fmt: skip


async def _add(db: asyncpg.Connection, aggregate: str, n: int) -> uuid.UUID:
    return await outbox.add_event(
        db, aggregate_type="alarm", aggregate_id=aggregate, event_type=f"e{n}", payload={"n": n}
    )


async def test_one_aggregate_is_published_in_order_while_others_proceed(
    db: asyncpg.Connection,
) -> None:
    for n in range(3):
        await _add(db, "A", n)
    await _add(db, "B", 0)
    first = await outbox.claim_due(db, node_id="n1", lease_s=30, limit=10)
    assert [(e.aggregate_id, e.event_type) for e in first] == [("A", "e0"), ("B", "e0")]
    # Nothing behind an unpublished head, whoever asks.
    assert await outbox.claim_due(db, node_id="n2", lease_s=30, limit=10) == []
    assert await outbox.mark_published(db, first[0].id, "n1")
    second = await outbox.claim_due(db, node_id="n2", lease_s=30, limit=10)
    assert [(e.aggregate_id, e.event_type) for e in second] == [("A", "e1")]


async def test_a_failed_publish_backs_off_and_only_the_lease_holder_may_finish(
    db: asyncpg.Connection,
) -> None:
    await _add(db, "A", 0)
    (claimed,) = await outbox.claim_due(db, node_id="n1", lease_s=30, limit=10)
    assert not await outbox.mark_published(db, claimed.id, "someone-else")
    assert await outbox.mark_failed(db, claimed.id, "n1", retry_in_s=60, error="broker down") == 1
    assert await outbox.claim_due(db, node_id="n1", lease_s=30, limit=10) == []  # not yet due
    await db.execute("UPDATE outbox_event SET next_retry_at = now()")
    (again,) = await outbox.claim_due(db, node_id="n2", lease_s=30, limit=10)
    assert again.retry_count == 1
    assert await outbox.mark_published(db, again.id, "n2")
    row = await db.fetchrow("SELECT status, last_error, published_at FROM outbox_event")
    assert row["status"] == "PUBLISHED"
    assert row["last_error"] is None
    assert row["published_at"] is not None
    backlog, _ = await outbox.backlog(db)
    assert backlog == 0


async def test_an_expired_lease_is_taken_over(db: asyncpg.Connection) -> None:
    await _add(db, "A", 0)
    (claimed,) = await outbox.claim_due(db, node_id="dead", lease_s=30, limit=10)
    await db.execute("UPDATE outbox_event SET lease_until = now() - interval '1 second'")
    (taken,) = await outbox.claim_due(db, node_id="alive", lease_s=30, limit=10)
    assert taken.id == claimed.id
    assert not await outbox.mark_published(db, claimed.id, "dead")
    assert await outbox.mark_published(db, taken.id, "alive")


async def test_consumers_record_each_event_once(db: asyncpg.Connection) -> None:
    event_id = await _add(db, "A", 0)
    assert await outbox.record_consumed(db, "ai-summaries", event_id)
    assert not await outbox.record_consumed(db, "ai-summaries", event_id)
    assert await outbox.record_consumed(db, "webhook", event_id)  # another consumer


async def test_the_backlog_gauges_are_read_once_per_interval_not_on_every_pass(
    pool: asyncpg.Pool, db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counting the backlog visits every unpublished event: the publisher reads it at most once
    per BACKLOG_EVERY_S (first: never again; then: every pass)."""
    monkeypatch.setattr(publisher_module, "BACKLOG_EVERY_S", 1e9)
    published: list[str] = []

    async def publish(topic: str, _payload: bytes) -> None:
        published.append(topic)

    metrics = Metrics()
    publisher = OutboxPublisher(
        pool=pool, dsn=db_dsn, node_id="n1", topics=Topics("iot"), publish=publish,
        metrics=metrics, batch=1,
    )  # fmt: skip
    async with pool.acquire() as conn:
        for n in range(3):
            await _add(conn, f"agg-{n}", n)

    def backlog() -> float | None:
        return metrics.registry.get_sample_value("gateway_outbox_backlog")

    assert await publisher.run_once() == 1
    assert backlog() == 3  # the first pass reads it (the claimed one is not published yet)
    assert await publisher.run_once() == 1
    assert await publisher.run_once() == 1
    assert await publisher.run_once() == 0
    assert backlog() == 3  # not read again, busy or idle, within the interval
    monkeypatch.setattr(publisher_module, "BACKLOG_EVERY_S", 0.0)
    assert await publisher.run_once() == 0
    assert backlog() == 0  # the interval passed: read
    assert len(published) == 3


async def test_the_broker_session_being_down_costs_an_event_no_retry(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """Down: nothing is claimed. Gone mid-publish (SessionDown): due again at once, retry_count
    unchanged. Any other failure: retried with backoff, as before. A reconnect wakes it."""
    up = {"now": False}
    failure: dict[str, Exception] = {"now": SessionDown("the broker connection ended")}

    async def publish(_topic: str, _payload: bytes) -> None:
        raise failure["now"]

    link = BrokerLink(lambda: up["now"])
    publisher = OutboxPublisher(
        pool=pool, dsn=db_dsn, node_id="n1", topics=Topics("iot"), publish=publish,
        metrics=Metrics(), retry_base_s=60, retry_cap_s=600, broker=link,
    )  # fmt: skip
    async with pool.acquire() as conn:
        await _add(conn, "agg", 0)

        async def event() -> asyncpg.Record:
            row = await conn.fetchrow(
                "SELECT status, retry_count, lease_owner, next_retry_at <= now() AS due,"
                " last_error FROM outbox_event"
            )
            assert row is not None
            return row

        assert await publisher.run_once() == 0  # the session is down: nothing claimed
        assert (await event())["lease_owner"] is None
        up["now"] = True
        assert await publisher.run_once() == 1  # claimed; the session went down meanwhile
        released = await event()
        assert tuple(released)[:4] == ("PENDING", 0, None, True)
        assert "the broker connection ended" in released["last_error"]
        failure["now"] = aiomqtt.MqttError("publish refused")
        assert await publisher.run_once() == 1
        failed = await event()
        assert tuple(failed)[:4] == ("PENDING", 1, None, False)
    assert not publisher._wakeup.is_set()
    link.connected()
    assert publisher._wakeup.is_set()


async def test_creations_that_reached_nobody_are_marked_published_together(
    pool: asyncpg.Pool, db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An alarm storm's creation events, published to no subscriber with no quiet hours to
    decide: nothing can change their alarms, so they are marked published in one statement
    with the informing events, not in a transaction each (10,000 of them in the bench's
    storm). One that reached someone still goes through the push, alone, and is PUSHED."""
    singles: list[int] = []
    mark_one = outbox.mark_published

    async def counted(conn: asyncpg.Connection, event_id: int, node_id: str) -> bool:
        singles.append(event_id)
        return await mark_one(conn, event_id, node_id)

    monkeypatch.setattr(publisher_module.outbox, "mark_published", counted)
    engine = AlarmEngine(rules=STORM_RULES, node_id="n1", metrics=Metrics())
    devices = [f"dev-{n:02d}" for n in range(40)]
    async with pool.acquire() as conn:
        for value in (20.0, 95.0):  # known devices, then all cross at once
            async with conn.transaction():
                await engine.on_stored(
                    conn,
                    [(d, f"{d}-{value}", Telemetry(ts=T0, seq=int(value), metrics={"temp": value}))
                     for d in devices],
                )  # fmt: skip
        alarms = [row["id"] for row in await conn.fetch("SELECT id FROM alarm ORDER BY id")]
    assert len(alarms) == 40
    reached = str(alarms[7])

    async def publish(topic: str, _payload: bytes) -> int:
        # 0: the broker had subscribers; 0x10: no matching subscribers.
        return 0 if topic.rsplit("/", 1)[-1] == reached else 0x10

    publisher = OutboxPublisher(
        pool=pool, dsn=db_dsn, node_id="n1", topics=Topics("iot"), publish=publish,
        metrics=Metrics(), batch=100,
    )  # fmt: skip
    assert await publisher.run_once() == 40
    async with pool.acquire() as conn:
        events = await conn.fetch(
            "SELECT event_type, status, count(*) AS n FROM outbox_event GROUP BY 1, 2 ORDER BY 1"
        )
        statuses = await conn.fetch("SELECT status, count(*) AS n FROM alarm GROUP BY status")
    assert [tuple(row) for row in events] == [
        (EventType.ALARM_CREATED, "PUBLISHED", 40),
        (EventType.ALARM_STATUS_CHANGED, "PENDING", 1),  # the push's own event, published next
    ]
    assert {row["status"]: row["n"] for row in statuses} == {"NEW": 39, "PUSHED": 1}
    assert len(singles) == 1  # only the one that reached someone, in a transaction of its own


def _rows_read(plan: dict[str, Any]) -> int:
    """Rows a plan's scans produced or filtered out, over all their loops (EXPLAIN shows both
    per loop)."""
    return sum(
        (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
        for node in plan_nodes(plan)
        if "Scan" in node["Node Type"]
    )


@pytest.mark.parametrize("statistics", ["taken-empty", "taken-on-history", "taken-on-backlog"])
async def test_a_claim_reads_rows_by_the_batch_not_by_the_backlog(
    db: asyncpg.Connection, statistics: str
) -> None:
    """A storm leaves thousands of events to publish, and the table's statistics are whatever
    they were before it: taken while it was empty, or while it held only published history.
    A claim of 10 must read rows by the batch (its 10, the 2 it skips, and for each one the
    lookup of its aggregate's oldest open event), not by the backlog: written as an anti-join
    it read all 2,000 (a hash of them, statistics taken empty) or all 2,000 for every row it
    examined (a nested loop, taken on history: 78-95 ms of PostgreSQL's CPU a claim of 100
    in a 10,000-event storm, `scripts/hot-path claim`)."""
    if statistics == "taken-on-history":
        await db.execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,"
            " payload, status, published_at)"
            " SELECT gen_random_uuid(), 'alarm', 'old-' || n, 'e', '{}', 'PUBLISHED', now()"
            " FROM generate_series(1, 5000) n"
        )
    if statistics != "taken-on-backlog":
        await db.execute("ANALYZE outbox_event")
    for n in range(3):  # one aggregate with three events first: only its oldest is claimable
        await _add(db, "A", n)
    await db.execute(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)"
        " SELECT gen_random_uuid(), 'alarm', 'storm-' || n, 'e', '{}'"
        " FROM generate_series(0, 1999) n ORDER BY n"
    )
    if statistics == "taken-on-backlog":
        await db.execute("ANALYZE outbox_event")
    statement = outbox.CLAIM_DUE.rstrip().rstrip(";")
    await db.execute(f"PREPARE claim(text, float8, int) AS {statement}")
    try:
        attempt = db.transaction()
        await attempt.start()
        try:
            await db.execute(outbox.CLAIM_PLAN)
            (explained,) = json.loads(
                await db.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim('n1', 30, 10)")
            )
            claimed = await db.fetch(
                "SELECT aggregate_id FROM outbox_event WHERE status = 'PUBLISHING' ORDER BY id"
            )
        finally:
            await attempt.rollback()
    finally:
        await db.execute("DEALLOCATE claim")
    assert [r["aggregate_id"] for r in claimed] == ["A"] + [f"storm-{n}" for n in range(9)]
    assert _rows_read(explained["Plan"]) < 200, json.dumps(explained["Plan"], indent=1)


async def test_a_claim_refuses_to_run_inside_a_callers_transaction(
    db: asyncpg.Connection,
) -> None:
    """Its plan setting lasts to the end of the transaction it runs in: a caller's later
    statements would be planned with it."""
    await _add(db, "A", 0)
    async with db.transaction():
        with pytest.raises(RuntimeError, match="transaction of its own"):
            await outbox.claim_due(db, node_id="n1", lease_s=30, limit=10)
    assert await db.fetchval("SHOW enable_sort") == "on"
    (claimed,) = await outbox.claim_due(db, node_id="n1", lease_s=30, limit=10)
    assert claimed.aggregate_id == "A"
    assert await db.fetchval("SHOW enable_sort") == "on"
