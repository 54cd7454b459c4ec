"""An outbox event no topic can carry (an aggregate id the topic rules refuse: '/', '+', '#')
is DEAD with its reason, and the publisher goes on with the others. Before, the topic builder's
ValueError escaped the publisher and stopped the daemon; the event, still due in the outbox,
stopped it again at each restart, on every node (a Sparkplug device id was one such id)."""

from __future__ import annotations

import asyncpg
import pytest

from gateway.outbox.publisher import OutboxPublisher
from gateway.support.metrics import Metrics
from protocol import Topics
from storage import outbox

pytestmark = pytest.mark.synthetic_events


async def test_an_event_no_topic_can_carry_is_dead_and_the_others_are_published(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    sent: list[str] = []

    async def publish(topic: str, _payload: bytes) -> None:
        sent.append(topic)

    publisher = OutboxPublisher(
        pool=pool, dsn=db_dsn, node_id="n1", topics=Topics("iot"), publish=publish,
        metrics=Metrics(),
    )  # fmt: skip
    async with pool.acquire() as conn:
        for aggregate_id in ("pump-1", "pump+2", "pump-3"):
            await outbox.add_event(
                conn, aggregate_type="alarm", aggregate_id=aggregate_id, event_type="e",
                payload={"n": 1},
            )  # fmt: skip
        assert await publisher.run_once() == 3
        rows = await conn.fetch(
            "SELECT aggregate_id, status, last_error FROM outbox_event ORDER BY aggregate_id"
        )
        assert [(r["aggregate_id"], r["status"]) for r in rows] == [
            ("pump+2", "DEAD"), ("pump-1", "PUBLISHED"), ("pump-3", "PUBLISHED")
        ]  # fmt: skip
        assert "BAD_TOPIC" in (rows[0]["last_error"] or ""), rows[0]
        assert sorted(sent) == ["iot/events/alarm/pump-1", "iot/events/alarm/pump-3"]
        # Nothing is due again: the next pass claims nothing.
        assert await publisher.run_once() == 0
