"""The outbox audit: the backlog gauges during a broker outage. They are the documented signal
that events are not going out (docs/operations.md: `gateway_outbox_backlog`,
`gateway_outbox_oldest_age_seconds` growing); while the node's broker session is down the
publisher claims nothing, and must still keep them current, or a scrape of /metrics shows
the backlog of before the outage for as long as it lasts."""

from __future__ import annotations

import asyncpg
import pytest

from gateway.outbox import publisher as publisher_module
from gateway.outbox.publisher import OutboxPublisher
from gateway.support.broker_link import BrokerLink
from gateway.support.metrics import Metrics
from protocol import Topics
from tests.integration.services.test_outbox import _add


async def test_the_backlog_gauges_follow_the_backlog_while_the_broker_is_away(
    pool: asyncpg.Pool, db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher_module, "BACKLOG_EVERY_S", 0.0)
    published: list[str] = []

    async def publish(topic: str, _payload: bytes) -> None:
        published.append(topic)

    up = {"now": True}
    metrics = Metrics()
    publisher = OutboxPublisher(
        pool=pool, dsn=db_dsn, node_id="n1", topics=Topics("iot"), publish=publish,
        metrics=metrics, broker=BrokerLink(lambda: up["now"]),
    )  # fmt: skip

    def gauge(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    assert await publisher.run_once() == 0
    assert gauge("gateway_outbox_backlog") == 0
    up["now"] = False  # the broker goes away; events keep being written
    async with pool.acquire() as conn:
        for n in range(5):
            await _add(conn, f"agg-{n}", n)
        await conn.execute("UPDATE outbox_event SET created_at = now() - interval '10 minutes'")
    assert await publisher.run_once() == 0  # nothing claimed: the session is down
    assert gauge("gateway_outbox_backlog") == 5, "the backlog gauge froze during the outage"
    oldest = gauge("gateway_outbox_oldest_age_seconds")
    assert oldest is not None
    assert oldest >= 600
    up["now"] = True
    assert await publisher.run_once() == 5
    assert len(published) == 5
