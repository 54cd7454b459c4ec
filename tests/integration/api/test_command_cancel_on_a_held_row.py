"""A command (or its device) whose row another transaction holds and does not end: a node
stopped in the middle of a dispatch, or of a batch of its device's telemetry. An operator's
cancel, or unbind, waits for the row, holding a pooled connection, which the node's ingest
shares. It must give up within a bound, 503 ``UNAVAILABLE``, nothing changed (as an alarm's
action does: test_alarm_action_on_a_held_row.py), and work once the row is free. Real
PostgreSQL, real HTTP, the row held by a test connection."""

from __future__ import annotations

import aiohttp
import asyncpg

from gateway.config import TokenConfig
from tests.integration.api.test_alarm_action_on_a_held_row import _within
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.api_server import serve_api

TOKENS = [TokenConfig(token=OPERATOR, role="operator", name="night shift")]


async def test_a_cancel_or_an_unbind_on_a_held_row_gives_up_in_bounded_time(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('pump-7', now(), now())"
    )
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        client = ApiClient(served.base, http)
        created = await client.call(
            "POST", "/devices/pump-7/commands", token=OPERATOR, json={"name": "reboot"}
        )
        assert created.status == 201, created.body
        command_id = created.body["command"]["id"]

        holder = await asyncpg.connect(db_dsn)
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM command WHERE id = $1 FOR UPDATE", command_id)
                cancel = await _within(
                    "a cancel of a held command",
                    client.call("POST", f"/commands/{command_id}/cancel", token=OPERATOR),
                )
                assert (cancel.status, cancel.body["error"]) == (503, "UNAVAILABLE"), cancel.body
                assert "held by another transaction" in cancel.body["message"]
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM device WHERE device_id = 'pump-7' FOR UPDATE")
                unbind = await _within(
                    "an unbind of a held device",
                    client.call("POST", "/devices/pump-7/unbind", token=OPERATOR),
                )
                assert (unbind.status, unbind.body["error"]) == (503, "UNAVAILABLE"), unbind.body
        finally:
            await holder.close()
        assert await db.fetchval("SELECT status FROM command WHERE id = $1", command_id) == (
            "PENDING"
        )
        assert await db.fetchval("SELECT bound FROM device WHERE device_id = 'pump-7'")

        # The rows free again: the same requests work.
        cancel = await client.call("POST", f"/commands/{command_id}/cancel", token=OPERATOR)
        assert (cancel.status, cancel.body["status"]) == (200, "CANCELLED"), cancel.body
        unbind = await client.call("POST", "/devices/pump-7/unbind", token=OPERATOR)
        assert unbind.status == 200, unbind.body
