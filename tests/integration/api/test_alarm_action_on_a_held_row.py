"""An alarm whose row another transaction holds and does not end: a node stopped in the middle
of a change (its VM paused, its link to PostgreSQL cut without a reset, which the server notices
only when its TCP keepalive gives up, hours later). Operators' actions on that alarm wait for
the row; each holds a pooled connection while it waits. They must give up within a bound (503
``UNAVAILABLE``, nothing changed), and the rest of the API must keep answering; once the row is
free the same action works, without a restart. Real PostgreSQL, real HTTP, the row held by a
test connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import TypeVar

import aiohttp
import asyncpg

from gateway.config import TokenConfig
from tests.support.alarm_history import raise_alarm
from tests.support.api_client import OPERATOR, VIEWER, ApiClient, Reply
from tests.support.api_server import serve_api
from tests.support.held_batch import lock_waiters
from tests.support.waiting import wait_until

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="night shift"),
]
POOL = 20  # serve_api's pool
PILE = 25  # operators' clicks on the held alarm: more than the pool has connections
BOUND_S = 15.0  # what an operator may wait for an answer, whatever holds the row

T = TypeVar("T")


async def _within(what: str, call: Awaitable[T]) -> T:
    try:
        async with asyncio.timeout(BOUND_S):
            return await call
    except TimeoutError:
        raise AssertionError(f"{what}: no answer within {BOUND_S:g} s") from None


def _http() -> aiohttp.ClientSession:
    """A connection per request: the clicks' connections sit idle while the test waits, and one
    reused just as the server closes it for its keep-alive timeout (uvicorn's 5 s) is reset
    under the request (CI once: 'ClientOSError: [Errno 104] Connection reset by peer' on the
    request after the row was freed). A browser sends such a request again; aiohttp does not."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def test_actions_on_a_held_alarm_give_up_in_bounded_time_and_leave_the_api_up(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    now = datetime.now(UTC)
    held = await raise_alarm(db, "door-open", "door-1", now)
    free = await raise_alarm(db, "door-open", "door-2", now)
    holder = await asyncpg.connect(db_dsn)
    hold = holder.transaction()
    async with serve_api(db_dsn, TOKENS) as served, _http() as http:
        client = ApiClient(served.base, http)

        async def confirm(alarm_id: int) -> Reply:
            return await client.call(
                "POST", f"/alarms/{alarm_id}/confirm", token=OPERATOR, json={"note": "on my way"}
            )

        clicks: list[asyncio.Task[Reply]] = []
        try:
            await hold.start()
            await holder.execute("SELECT 1 FROM alarm WHERE id = $1 FOR UPDATE", held)
            clicks = [asyncio.create_task(confirm(held)) for _ in range(PILE)]

            async def pool_taken() -> bool:
                return len(await lock_waiters(db_dsn)) >= POOL

            await wait_until(pool_taken, message="every pooled connection waits for the row")

            # The rest of the API answers meanwhile: a list, an action on another alarm.
            listed = await _within("GET /alarms while one alarm is held", client.get("/alarms"))
            assert listed.status == 200, listed.body
            other = await _within("confirming another alarm", confirm(free))
            assert other.status == 200, other.body
            assert other.body["status"] == "CONFIRMED"

            # Every click on the held alarm gave up: 503, its id, nothing changed.
            answers = await _within("the clicks on the held alarm", asyncio.gather(*clicks))
            for answer in answers:
                assert answer.status == 503, answer.body
                assert answer.body["error"] == "UNAVAILABLE"
                assert answer.body["alarm_id"] == held
            assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", held) == "NEW"
        finally:
            if not holder.is_closed():
                await hold.rollback()
                await holder.close()
            await asyncio.gather(*clicks, return_exceptions=True)

        # The row free again: the same action works, once.
        again = await _within("confirming the alarm once free", confirm(held))
        assert again.status == 200, again.body
        assert again.body["confirmed_by"] == "night shift"
        confirms = await db.fetchval(
            "SELECT count(*) FROM alarm_audit WHERE alarm_id = $1 AND action = 'confirm'", held
        )
        assert confirms == 1


async def test_a_bulk_action_skips_the_held_alarm_and_acts_on_the_others(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    now = datetime.now(UTC)
    held = await raise_alarm(db, "door-open", "door-1", now)
    others = [await raise_alarm(db, "door-open", f"door-{n}", now) for n in (2, 3)]
    holder = await asyncpg.connect(db_dsn)
    try:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM alarm WHERE id = $1 FOR UPDATE", held)
            async with serve_api(db_dsn, TOKENS) as served, _http() as http:
                client = ApiClient(served.base, http)
                body = {"action": "confirm", "ids": [held, *others], "note": "storm"}
                reply = await _within(
                    "a bulk action over a held alarm",
                    client.call("POST", "/alarms/bulk", token=OPERATOR, json=body),
                )
            await holder.execute("SELECT 1")  # still holding: the bulk gave up on its own
    finally:
        await holder.close()
    assert reply.status == 200, reply.body
    items = {item["alarm_id"]: item for item in reply.body["items"]}
    assert items[held]["ok"] is False
    assert items[held]["error"] == "UNAVAILABLE"
    assert "outcome_unknown" not in items[held]  # refused: nothing of it was written
    assert [items[i]["status"] for i in others] == ["CONFIRMED", "CONFIRMED"]
    assert reply.body["done"] == 2
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", held) == "NEW"
