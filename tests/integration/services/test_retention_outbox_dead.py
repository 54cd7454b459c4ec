"""Outbox events the broker can never take (DEAD) are pruned once they are older than
``[retention] outbox_dead_days`` (docs/operations.md, "Retention and disk"): a fleet with a
recurring poison event (a command whose params are over the broker's limit, every day) no
longer grows ``outbox_event`` for ever. A DEAD event younger than the window stays, for the
operator to read its ``last_error``; so does every event not yet published."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from gateway.config import RetentionConfig
from gateway.maintenance.runner import Maintenance
from gateway.support.metrics import Metrics
from storage import outbox
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

# A placeholder event type: nothing consumes it, the broker refuses it for its size.
pytestmark = pytest.mark.synthetic_events

LIMIT = 4096


async def test_a_dead_event_is_pruned_past_its_window_and_kept_inside_it(
    db_dsn: str, db: asyncpg.Connection, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    broker = Mosquitto(tmp_path / "mosquitto", extra_config=f"message_size_limit {LIMIT}\n")
    broker.start()
    try:
        config = make_config(dsn=db_dsn, mqtt_port=broker.port, protocol="5")
        async with running_daemon(config):
            await outbox.add_event(
                db, aggregate_type="alarm", aggregate_id="poison", event_type="e",
                payload={"blob": "x" * (2 * LIMIT)},
            )  # fmt: skip
            await outbox.add_event(
                db, aggregate_type="alarm", aggregate_id="fine", event_type="e",
                payload={"blob": "x"},
            )  # fmt: skip

            async def settled() -> bool:
                rows = await db.fetch("SELECT aggregate_id, status FROM outbox_event")
                return {r["aggregate_id"]: r["status"] for r in rows} == {
                    "poison": "DEAD",
                    "fine": "PUBLISHED",
                }

            await wait_until(settled, timeout=30, message="one event DEAD, one PUBLISHED")
    finally:
        broker.stop()
    # An event still open, however old: never pruned.
    await outbox.add_event(
        db, aggregate_type="alarm", aggregate_id="open", event_type="e",
        payload={"blob": "x"},
    )  # fmt: skip

    # One given up by a node of the previous release (a rolling upgrade): no dead_at of its own.
    await outbox.add_event(
        db, aggregate_type="alarm", aggregate_id="old-node", event_type="e",
        payload={"blob": "x"},
    )  # fmt: skip
    await db.execute(
        "UPDATE outbox_event SET status = 'DEAD', last_error = 'PACKET_TOO_LARGE: old node' "
        "WHERE aggregate_id = 'old-node'"
    )

    now: datetime = await db.fetchval("SELECT now()")
    metrics = Metrics()

    async def pass_at(days: float) -> None:
        report = await Maintenance(
            pool=pool, retention=RetentionConfig(telemetry_days=0), metrics=metrics,
            db_clock=lambda: now + timedelta(days=days),
        ).run_once()  # fmt: skip
        assert report.ran

    async def left() -> dict[str, str]:
        rows = await db.fetch("SELECT aggregate_id, status FROM outbox_event")
        return {r["aggregate_id"]: r["status"] for r in rows}

    retention = RetentionConfig()
    # Past the published events' window, inside the dead ones': the DEAD event stays.
    await pass_at(retention.outbox_days + 1)
    assert await left() == {"poison": "DEAD", "old-node": "DEAD", "open": "PENDING"}
    # Past the dead events' window too: it goes, and is counted.
    await pass_at(max(retention.outbox_days, 30) * 13)
    assert await left() == {"open": "PENDING"}, "a DEAD outbox event is never pruned"
    deleted = metrics.registry.get_sample_value(
        "gateway_retention_deleted_total", {"table": "outbox_event_dead"}
    )
    assert deleted == 2
