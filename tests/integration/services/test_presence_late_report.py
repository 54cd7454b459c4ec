"""A device's reading read off the broker before its Will, stored after it: node A reads the
device's last report and is a batch behind (a database outage holds every writer's batch);
node B reads the Will `offline` a moment later and stores it first, and a pass of the
inactivity monitor raises "presence offline". Node A's report, stored then, says nothing of
the silence that began after it was read: the alarm stays. The device's next report, read
after the Will, clears it. Each node's store steps are run directly on one database, with
the receipt times the session stamps (the loop's clock), as in test_presence_order."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import asyncpg
import msgspec

from gateway.alarms.engine import AlarmEngine
from gateway.alarms.inactivity import InactivityMonitor
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.ingest.decoder import Inbound
from gateway.ingest.store import store
from gateway.support.metrics import Metrics
from protocol import Telemetry
from tests.integration.services.test_presence_order import (
    DECODER,
    DEVICE,
    SILENT_300,
    TOPICS,
    _monitor,
    _online_since_a_while,
    _status,
    _warm,
)

ENGINE = AlarmEngine(rules=SILENT_300, node_id="node-a", metrics=Metrics())


def _report(seq: int, received_at: float) -> Inbound:
    payload = msgspec.json.encode(Telemetry(ts=datetime.now(UTC), seq=seq, metrics={"t": 20.0}))
    return Inbound(TOPICS.telemetry(DEVICE), payload, received_at)


async def _store(
    conn: asyncpg.Connection, node: str, *items: Inbound, engine: AlarmEngine = ENGINE
) -> None:
    async with conn.transaction():
        await store(conn, DECODER.classify(list(items)), node, engine)


async def _open_alarms(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(
        await db.fetch(
            "SELECT id, trigger ->> 'silent_since' AS since FROM alarm"
            " WHERE device_id = $1 AND cleared_at IS NULL",
            DEVICE,
        )
    )


async def test_a_report_read_before_the_will_and_stored_after_it_leaves_the_alarm_open(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str
) -> None:
    await _online_since_a_while(db)
    report_read_by_a = time.monotonic() - 0.300
    will_read_by_b = report_read_by_a + 0.050
    node_a = await asyncpg.connect(db_dsn)
    try:
        await _warm(node_a, "node-a")
        async with pool.acquire() as node_b:
            await _warm(node_b, "node-b")
            await _store(node_b, "node-b", _status("offline", will_read_by_b))
        [alarm] = [await _monitor(pool).run_once()]
        assert len(alarm) == 1
        [open_] = await _open_alarms(db)
        assert open_["since"] is not None
        await _store(node_a, "node-a", _report(1, report_read_by_a))
        assert await _open_alarms(db) == [open_], (
            "a report read before the Will cleared the alarm of the silence after it"
        )
        # The device's next report, read after the Will: the silence is over.
        await _store(node_a, "node-a", _report(2, time.monotonic()))
    finally:
        await node_a.close()
    assert await _open_alarms(db) == []


async def test_a_report_read_before_a_silence_began_and_stored_after_its_alarm_leaves_it_open(
    db: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """The silence alarm's form (a rule of 5 s): the device's last report was stored 10 s
    ago (its last_seen); the monitor raises "silent for more than 5s". A node held since
    before then (its batch behind a database outage) stores a report it read 20 s ago: the
    device was silent all the same, the alarm stays. A report read now clears it."""
    rules = compile_rules(
        [RuleConfig(key="silent", kind="inactivity", severity="WARNING", silent_seconds=5)]
    )
    engine = AlarmEngine(rules=rules, node_id="node-a", metrics=Metrics())
    await _online_since_a_while(db)
    await db.execute(
        "UPDATE device SET last_seen = now() - interval '10 seconds' WHERE device_id = $1",
        DEVICE,
    )
    assert len(await InactivityMonitor(pool=pool, engine=engine, interval_s=1).run_once()) == 1
    [open_] = await _open_alarms(db)
    await _store(db, "node-a", _report(1, time.monotonic() - 20.0), engine=engine)
    assert await _open_alarms(db) == [open_], "a report read before the silence cleared it"
    await _store(db, "node-a", _report(2, time.monotonic()), engine=engine)
    assert await _open_alarms(db) == []
