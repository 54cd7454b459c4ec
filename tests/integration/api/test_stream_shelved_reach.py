"""A console stream and a shelved alarm: the console leaves shelved alarms out of its list,
so an alarm raised under a shelf that a stream wrote to its client reached nobody. It stays
NEW (and is measured for "unreached" from the shelf's end), where an alarm of the same moment
not shelved is pushed by the same stream. Real HTTP (the stream read as a client reads it)
against real PostgreSQL."""

from __future__ import annotations

import uuid

import aiohttp
import asyncpg

from gateway.alarms.lifecycle import create_alarm
from storage.alarms import db_now
from tests.integration.api.test_alarm_desk_api import TOKENS
from tests.support.api_client import OPERATOR, VIEWER, ApiClient
from tests.support.api_server import serve_api
from tests.support.sse import open_stream
from tests.support.waiting import wait_until


async def _raise(db: asyncpg.Connection, device: str) -> int:
    async with db.transaction():
        created = await create_alarm(
            db, device_id=device, rule_key="hot", severity="MAJOR",
            telemetry_event_id=uuid.uuid4().hex, reason="test", node_id="n",
            now=await db_now(db),
        )  # fmt: skip
    assert created.alarm is not None
    return created.alarm.id


async def _status(db: asyncpg.Connection, alarm_id: int) -> str:
    return str(await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id))


async def test_a_console_stream_does_not_push_an_alarm_raised_under_a_shelf(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        api = ApiClient(base=served.base, http=http)
        shelf = await api.call(
            "POST",
            "/shelves",
            json={"device_id": "boiler-3", "rule_key": "hot", "duration_s": 3600,
                  "reason": "sensor being replaced"},
            token=OPERATOR,
        )  # fmt: skip
        assert shelf.status == 201, shelf.body
        async with open_stream(http, served.base, token=VIEWER) as stream:
            await stream.live()
            shelved = await _raise(db, "boiler-3")
            seen = await _raise(db, "pump-1")
            after = await _raise(db, "pump-2")  # asks the stream for one more chunk
            created = [e for e in await stream.take(4) if e.event == "alarm.created"]
            assert [int(e.data["aggregate_id"]) for e in created] == [shelved, seen, after]
            listed = await api.get("/alarms?open=true")
            assert shelved not in [a["id"] for a in listed.body["items"]]  # the console's view

            async def seen_pushed() -> bool:
                return await _status(db, seen) == "PUSHED"

            # The round that pushed `seen` judged `shelved` too (written before it).
            await wait_until(seen_pushed, message="the stream pushed the alarm it wrote")
            assert await _status(db, shelved) == "NEW"
            pushes = await db.fetchval(
                "SELECT count(*) FROM alarm_audit WHERE alarm_id = $1 AND action = 'push'",
                shelved,
            )
            assert pushes == 0
