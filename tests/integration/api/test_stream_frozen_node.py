"""A node that stops in the middle of a transaction: its VM paused, its process stopped, or its
link to PostgreSQL cut without a reset (PostgreSQL keeps such a session until its TCP keepalive
gives up, hours later). The stream sends an event only once every older transaction of the
server has ended (docs/api.md, exact resume), so that frozen transaction held back every
stream on every node, with every event the other nodes committed, for as long as it lasted;
and it kept its row locks. PostgreSQL must end a gateway session left idle in a transaction
(its change rolled back; the node, if it comes back, finds its connection gone and retries),
and the streams go on within a bound. Real PostgreSQL, real HTTP, the frozen node a pool made
as the daemon makes it."""

from __future__ import annotations

import aiohttp
import asyncpg
import pytest

from gateway.config import TokenConfig
from storage import outbox
from storage.errors import TRANSIENT_DB_ERRORS
from storage.pool import IDLE_IN_TRANSACTION_S, create_pool
from tests.support.api_client import VIEWER
from tests.support.api_server import serve_api
from tests.support.sse import open_stream

TOKENS = [TokenConfig(token=VIEWER, role="viewer", name="wall-screen")]
# What the stream may lag behind a frozen node: PostgreSQL's timeout, then a poll or two.
BOUND_S = IDLE_IN_TRANSACTION_S + 15.0


async def _event(conn: asyncpg.Connection, name: str) -> None:
    await outbox.add_event(
        conn, aggregate_type="test", aggregate_id=name, event_type=f"test.{name}",
        payload={"name": name},
    )  # fmt: skip


async def test_a_node_frozen_in_a_transaction_holds_the_streams_back_only_for_a_bound(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    frozen_node = await create_pool(db_dsn, min_size=1, max_size=1, application_name="gw:frozen")
    try:
        async with (
            serve_api(db_dsn, TOKENS) as served,
            aiohttp.ClientSession() as http,
            open_stream(http, served.base, token=VIEWER) as stream,
        ):
            await stream.live()
            async with frozen_node.acquire() as frozen:
                change = frozen.transaction()
                await change.start()
                await _event(frozen, "frozen")  # its change, in flight: then it stops
                await _event(db, "other-node")  # another node's, committed
                try:
                    got = await stream.next(timeout=BOUND_S)
                except TimeoutError:
                    raise AssertionError(
                        f"no event within {BOUND_S:g} s while a node is frozen in a transaction"
                    ) from None
                assert got.data["aggregate_id"] == "other-node"
                # PostgreSQL ended the frozen session: its change was rolled back, never sent.
                with pytest.raises(TRANSIENT_DB_ERRORS):
                    await frozen.fetchval("SELECT 1")
            await _event(db, "next")
            assert (await stream.next()).data["aggregate_id"] == "next"
        assert (
            await db.fetchval("SELECT count(*) FROM outbox_event WHERE aggregate_id = 'frozen'")
            == 0
        )
    finally:
        await frozen_node.close()
