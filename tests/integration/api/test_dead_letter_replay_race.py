"""A dead letter replayed over the API while another node raises the same alarm: the
replay's alarm insert waits for the other node's uncommitted alarm of the same device and
rule, which then commits. The live writer retries such a batch (it then sees the alarm, and
supersedes it as any refire does); the replay answered 500 INTERNAL, a traceback in the log,
and the letter stayed pending although nothing was wrong with it. Forced deterministically:
the other node's transaction is held open until the replay waits on it."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from gateway.alarms.lifecycle import create_alarm
from storage.alarms import db_now
from tests.integration.api.test_console_api import TOKENS, add_dead_letter
from tests.support.api_client import ADMIN, ApiClient
from tests.support.api_server import serve_api
from tests.support.held_batch import lock_waiters
from tests.support.waiting import wait_until

CONFIG = """
[node]
id = "api-test"

[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
severity = "MAJOR"
"""


@pytest.fixture
async def api(db_dsn: str) -> AsyncIterator[ApiClient]:
    async with serve_api(db_dsn, TOKENS, CONFIG) as served, aiohttp.ClientSession() as http:
        yield ApiClient(served.base, http)


async def test_a_replay_racing_another_nodes_alarm_is_stored_not_a_500(
    api: ApiClient, db: asyncpg.Connection, db_dsn: str
) -> None:
    hot = json.dumps({"ts": "2026-11-30T12:00:00Z", "metrics": {"temp": 95}}).encode()
    letter = await add_dead_letter(db, hot, "STORAGE_REJECTED", "iot/devices/oven-1/telemetry")
    other = await asyncpg.connect(db_dsn)
    try:
        held = other.transaction()
        await held.start()
        created = await create_alarm(
            other, device_id="oven-1", rule_key="temp-high", severity="MAJOR",
            telemetry_event_id=hashlib.sha256(b"other").hexdigest(), reason="other node",
            node_id="node-b", now=await db_now(other),
        )  # fmt: skip
        assert created.alarm is not None
        replaying = asyncio.create_task(
            api.call("POST", f"/dead-letters/{letter}/replay", token=ADMIN)
        )
        await wait_until(lambda: lock_waiters(db_dsn), message="the replay waits on the alarm")
        await held.commit()
        reply = await replaying
    finally:
        await other.close()
    assert reply.status == 200, reply.body
    assert (reply.body["outcome"], reply.body["succeeded"]) == ("stored", True)
    rows = await db.fetch(
        "SELECT status, node_id FROM alarm WHERE device_id = 'oven-1' ORDER BY id"
    )
    assert [r["status"] for r in rows] == ["SUPERSEDED", "NEW"]
    assert await db.fetchval(
        "SELECT replayed_at IS NOT NULL FROM dead_letter WHERE id = $1", letter
    )
