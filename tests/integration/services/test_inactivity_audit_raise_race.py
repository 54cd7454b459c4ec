"""An inactivity alarm raised while the device's message is being stored (audit A).

A pass of the monitor reads the silent devices, then raises an alarm for each, one
transaction each (a large fleet after a site outage: thousands, seconds apart). A device
heard from between the two, its message stored and its inactivity alarms cleared before the
alarm was written, used to be alarmed anyway, for the silence its message had just ended, and
nothing cleared that alarm until the device's next message (hours, for a device that reports
rarely). The interleaving is forced: a test transaction holds the audit table, so the
monitor's raise waits in PostgreSQL after its decision while the message is stored.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg
import msgspec

from gateway.alarms.engine import AlarmEngine
from gateway.ingest.decoder import Inbound
from gateway.ingest.store import store
from gateway.support.metrics import Metrics
from tests.integration.services.test_alarms import SILENT_300, _last_heard, _silence_monitor
from tests.integration.services.test_presence_order import DECODER, TOPICS
from tests.support.held_batch import lock_waiters
from tests.support.waiting import wait_until

DEVICE = "meter-7"


async def _heard(pool: asyncpg.Pool, engine: AlarmEngine) -> None:
    """The device's message, stored by `engine`'s node as its writer stores a batch."""
    body = msgspec.json.encode({"ts": int(time.time() * 1000), "metrics": {"kwh": 1.0}})
    batch = DECODER.classify([Inbound(TOPICS.telemetry(DEVICE), body, time.monotonic())])
    async with pool.acquire() as conn, conn.transaction():
        result = await store(conn, batch, engine.node_id, engine)
    assert result.alarms is not None
    engine.committed(result.alarms)


async def test_a_device_heard_while_its_silence_alarm_is_raised_is_left_with_no_open_alarm(
    pool: asyncpg.Pool, db: asyncpg.Connection, db_dsn: str
) -> None:
    await _last_heard(db, {DEVICE: 600})  # silent for 10 minutes, the rule's 300 s passed
    monitor = _silence_monitor(pool)  # listening all along
    ingest = AlarmEngine(rules=SILENT_300, node_id="node-b", metrics=Metrics())
    hold = await asyncpg.connect(db_dsn)
    try:
        tx = hold.transaction()
        await tx.start()
        await hold.execute("LOCK TABLE alarm_audit IN EXCLUSIVE MODE")
        passing = asyncio.create_task(monitor.run_once())
        await wait_until(lambda: lock_waiters(db_dsn), message="the monitor's raise waits")
        # The device is heard from: another node stores its message meanwhile.
        storing = asyncio.create_task(_heard(pool, ingest))

        async def stored_or_waiting() -> bool:
            return storing.done() or len(await lock_waiters(db_dsn)) >= 2

        await wait_until(stored_or_waiting, message="the message stored, or waiting its turn")
        await tx.rollback()
        await passing
        await storing
    finally:
        await hold.close()
    open_alarms = await db.fetch(
        "SELECT id, trigger::text AS trigger FROM alarm"
        " WHERE device_id = $1 AND cleared_at IS NULL",
        DEVICE,
    )
    assert [dict(r) for r in open_alarms] == [], "an alarm open for a device just heard from"
