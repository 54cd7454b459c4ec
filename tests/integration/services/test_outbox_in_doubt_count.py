"""What the in-doubt count (gateway.outbox.publisher, IN_DOUBT_LIMIT) takes from a connection
that ended mid-publish: only the largest of the events then written and unanswered; nothing
from a session that was down before anything was written."""

from __future__ import annotations

import asyncpg
import pytest

from gateway.outbox.publisher import IN_DOUBT_LIMIT, OutboxPublisher
from gateway.support.broker_link import PublishInDoubt, SessionDown
from gateway.support.metrics import Metrics
from protocol import Topics
from storage import outbox

pytestmark = pytest.mark.synthetic_events


async def _counts(conn: asyncpg.Connection) -> dict[str, tuple[str, int]]:
    rows = await conn.fetch("SELECT aggregate_id, status, in_doubt_count FROM outbox_event")
    return {r["aggregate_id"]: (r["status"], r["in_doubt_count"]) for r in rows}


async def test_only_the_largest_event_in_doubt_is_counted_and_a_plain_session_loss_never(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    failure: dict[str, Exception] = {"now": SessionDown("not connected to the broker")}

    async def publish(_topic: str, _payload: bytes) -> None:
        raise failure["now"]

    publisher = OutboxPublisher(
        pool=pool, dsn=db_dsn, node_id="n1", topics=Topics("iot"), publish=publish,
        metrics=Metrics(),
    )  # fmt: skip
    async with pool.acquire() as conn:
        for aggregate, size in (("small", 10), ("large", 1000), ("middle", 100)):
            await outbox.add_event(
                conn, aggregate_type="alarm", aggregate_id=aggregate, event_type="e",
                payload={"blob": "x" * size},
            )  # fmt: skip
        assert await publisher.run_once() == 3
        assert await _counts(conn) == {
            "small": ("PENDING", 0), "middle": ("PENDING", 0), "large": ("PENDING", 0)
        }  # fmt: skip
        failure["now"] = PublishInDoubt("no PUBACK before the connection ended")
        for times in range(1, IN_DOUBT_LIMIT):
            assert await publisher.run_once() == 3
            assert await _counts(conn) == {
                "small": ("PENDING", 0), "middle": ("PENDING", 0), "large": ("PENDING", times)
            }  # fmt: skip
        assert await publisher.run_once() == 3
        assert await _counts(conn) == {
            "small": ("PENDING", 0), "middle": ("PENDING", 0),
            "large": ("DEAD", IN_DOUBT_LIMIT - 1),
        }  # fmt: skip
        # The next largest is counted from then on, from nought.
        assert await publisher.run_once() == 2
        assert (await _counts(conn))["middle"] == ("PENDING", 1)
