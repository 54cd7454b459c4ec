"""The supersede chain of a device nobody attends: each firing of its rule supersedes the
unattended alarm before it (a door reported open every few seconds overnight, a sensor flapping
about its threshold), so the chain of its newest alarm holds every one of them. The console
reads it whenever an operator opens that alarm. It is not paged (docs/api.md): it must come in
one read, not a read per alarm. Real PostgreSQL, real HTTP."""

from __future__ import annotations

import time

import aiohttp
import asyncpg

from gateway.config import TokenConfig
from tests.support.api_client import VIEWER, ApiClient
from tests.support.api_server import serve_api

TOKENS = [TokenConfig(token=VIEWER, role="viewer", name="wall-screen")]
LENGTH = 20_000  # a firing every 4 s for a day
# One statement answers it in well under a second here; a read per alarm took 16 s.
BOUND_S = 5.0


async def _unattended_chain(db: asyncpg.Connection, length: int) -> list[int]:
    """``length`` alarms of one device and rule, each superseded by the next, the last NEW."""
    ids: list[int] = await db.fetchval(
        """WITH made AS (
               INSERT INTO alarm (device_id, rule_key, severity, status, telemetry_event_id,
                                  dedup_key, triggered_at, node_id, created_at, superseded_at)
               SELECT 'door-9', 'door-open', 'WARNING',
                      CASE WHEN g = $1 THEN 'NEW' ELSE 'SUPERSEDED' END, 'ev-' || g,
                      'door-open:door-9:ev-' || g, t, 'api-test', t,
                      CASE WHEN g = $1 THEN NULL ELSE t + interval '4 s' END
               FROM generate_series(1, $1) g,
                    LATERAL (SELECT now() - make_interval(secs => 4 * ($1 - g))) AS at(t)
               RETURNING id)
           SELECT array_agg(id ORDER BY id) FROM made""",
        length,
    )
    await db.execute(
        """UPDATE alarm a SET superseded_by = n.next
           FROM (SELECT id, lead(id) OVER (ORDER BY id) AS next FROM alarm
                 WHERE device_id = 'door-9') n
           WHERE a.id = n.id AND n.next IS NOT NULL"""
    )
    await db.execute("ANALYZE alarm")  # as autovacuum would have, after a day of them
    return ids


async def test_the_chain_of_an_unattended_device_comes_in_one_read(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    ids = await _unattended_chain(db, LENGTH)
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        client = ApiClient(served.base, http)
        started = time.monotonic()
        reply = await client.get(f"/alarms/{ids[-1]}/chain")
        took = time.monotonic() - started
        assert reply.status == 200, reply.body
        items = reply.body["items"]
        assert [item["id"] for item in items] == ids  # oldest first, every one
        assert all(item["superseded_by"] == n for item, n in zip(items, ids[1:], strict=False))
        assert items[-1]["status"] == "NEW"
        assert {item["shelved_until"] for item in items} == {None}
        assert {item["out_of_service"] for item in items} == {False}
        assert reply.body["hint"] is None
        assert took < BOUND_S, f"the chain of {LENGTH} alarms took {took:.1f} s"

        # A superseded alarm's chain is itself alone, with the hint, as before.
        middle, successor = ids[LENGTH // 2], ids[LENGTH // 2 + 1]
        alone = await client.get(f"/alarms/{middle}/chain")
        assert [item["id"] for item in alone.body["items"]] == [middle]
        assert alone.body["superseded_by"] == successor
        assert alone.body["hint"] == f"superseded by {successor}, cannot be handled on its own"
