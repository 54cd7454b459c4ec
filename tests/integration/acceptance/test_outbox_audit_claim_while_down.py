"""The outbox publisher claims nothing while the node's broker session is down, even a pass
that looked at the session before it had to wait for a database connection.

An outbox pass asks the session first, then waits for a pooled connection (a busy pool: an
ingest burst, a slow database), then claims. The session could go down during that wait: the
pass then claimed the due events for a broker it could not reach, every publish raised
``SessionDown`` and the events were released at once, unpublished: a claim and a release
written per event, each one's ``last_error`` set to the session's loss, and the events held
(``PUBLISHING``, this node's lease) from the nodes whose session was up, which find them only
at their next poll (a release sends no NOTIFY). No retry is counted, no backoff, no in-doubt.

Forced deterministically with a real mosquitto behind a TCP proxy and the real daemon: the
test takes every connection of the node's pool, writes an event (its NOTIFY wakes the pass,
which finds the session up and waits for a connection), cuts the link while the pass waits,
then gives the pool back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from gateway.outbox.publisher import OutboxPublisher
from protocol.events import Aggregate, DeviceServiceChanged, EventType
from storage import outbox
from storage.outbox import ClaimedEvent
from tests.support.daemon import make_config, running_daemon, session_down, session_up
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until


class Passes:
    """The node's outbox passes, counted: begun, over, and claim statements started."""

    def __init__(self) -> None:
        self.begun = 0
        self.over = 0
        self.claims = 0


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> Passes:
    counted = Passes()
    run_once: Callable[[OutboxPublisher], Any] = OutboxPublisher.run_once
    claim_due = outbox.claim_due

    async def counted_pass(self: OutboxPublisher) -> int:
        counted.begun += 1
        try:
            return int(await run_once(self))
        finally:
            counted.over += 1

    async def counted_claim(*args: Any, **kwargs: Any) -> list[ClaimedEvent]:
        counted.claims += 1
        return await claim_due(*args, **kwargs)

    monkeypatch.setattr(OutboxPublisher, "run_once", counted_pass)
    monkeypatch.setattr(outbox, "claim_due", counted_claim)
    return counted


async def _event(db: asyncpg.Connection) -> tuple[Any, ...]:
    row = await db.fetchrow(
        "SELECT status, retry_count, in_doubt_count, lease_owner, last_error FROM outbox_event"
    )
    assert row is not None
    return tuple(row)


async def test_a_pass_that_waited_for_a_connection_claims_nothing_once_the_session_went_down(
    db_dsn: str, mosquitto: Mosquitto, passes: Passes
) -> None:
    db = await asyncpg.connect(db_dsn)
    try:
        async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
            config = make_config(dsn=db_dsn, mqtt_port=proxy.port, node_id="node-a")
            async with running_daemon(config) as daemon:
                pool = daemon.pool
                assert pool is not None
                async with contextlib.AsyncExitStack() as taken:
                    for _ in range(pool.get_max_size()):
                        await taken.enter_async_context(pool.acquire())
                    claims = passes.claims
                    await outbox.add_event(
                        db,
                        aggregate_type=Aggregate.DEVICE,
                        aggregate_id="valve-1",
                        event_type=EventType.DEVICE_IN_SERVICE,
                        payload=DeviceServiceChanged(device_id="valve-1", period={}, actor="t"),
                    )
                    # Its NOTIFY woke a pass, which found the session up and waits for a
                    # connection (it started no claim), while the test holds them all.
                    await wait_until(
                        lambda: passes.begun == passes.over + 1 and passes.claims == claims,
                        timeout=30, message="a pass waiting for a connection",
                    )  # fmt: skip
                    waiting = passes.begun
                    await proxy.cut()
                    await wait_until(
                        lambda: session_down(daemon), timeout=30, message="session down"
                    )
                # The pool free again: the waiting pass goes on, and is over.
                await wait_until(
                    lambda: passes.over >= waiting, timeout=30, message="the waiting pass over"
                )
                assert await _event(db) == ("PENDING", 0, 0, None, None), (
                    "claimed (and released) while the session was down"
                )
                # The link back: the reconnect wakes the publisher, which publishes it.
                await proxy.resume()
                await wait_until(lambda: session_up(daemon), timeout=30, message="session back")

                async def published() -> bool:
                    return (await _event(db))[0] == "PUBLISHED"

                await wait_until(published, timeout=30, message="published after the reconnect")
    finally:
        await db.close()
