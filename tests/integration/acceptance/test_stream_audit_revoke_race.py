"""The stream audit: a reload that removes a token while a stream request of that token is
being answered (between its authentication and its stream's opening: the handler asks the
database whether the client's cursor is ahead) must not leave a stream of the removed token
open. `hub.revoke` cuts the streams open at the reload; one opened just after it was never
cut (docs/api.md, "Revoked tokens")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import asyncpg

from gateway.config import parse_config
from tests.integration.acceptance.test_stream_nodes import _broker, _config
from tests.support.api_client import VIEWER
from tests.support.daemon import running_daemon
from tests.support.waiting import wait_until

WALL = f"""
[[api.tokens]]
token = "{VIEWER}"
role = "viewer"
name = "wall-screen"
"""


async def test_a_token_removed_while_its_stream_request_waits_opens_no_stream(
    db_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    # An id was given out and rolled back: "0:1" is past every final event (the hub's head
    # is 0:0) yet not ahead of the sequence, so the handler asks the database about it.
    async with db.transaction():
        await db.execute("SELECT nextval(pg_get_serial_sequence('outbox_event', 'id'))")
    with _broker(tmp_path) as broker:
        config = parse_config(_config(db_dsn, broker, "node-a") + WALL)
        async with aiohttp.ClientSession() as http, running_daemon(config) as node:
            base = f"http://127.0.0.1:{node.http_port}"
            hub = node.services.stream_hub
            assert hub is not None
            await wait_until(lambda: hub.head is not None, message="the hub started")
            locker = await asyncpg.connect(db_dsn)
            try:
                tx = locker.transaction()
                await tx.start()
                # ALTER SEQUENCE holds a lock that pg_sequence_last_value waits for: the
                # cursor check waits here, the request authenticated.
                await locker.execute("ALTER SEQUENCE outbox_event_id_seq CACHE 1")
                request = asyncio.create_task(
                    http.get(
                        f"{base}/stream",
                        headers={"Authorization": f"Bearer {VIEWER}", "Last-Event-ID": "0:1"},
                        timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
                    )
                )

                async def waiting() -> bool:
                    return bool(
                        await db.fetchval(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                            " AND datname = current_database()"
                            " AND query LIKE '%pg_sequence_last_value%'"
                        )
                    )

                await wait_until(waiting, message="the stream request waits on the cursor check")
                # SIGHUP with the wall-screen token gone from the file.
                node.reload(parse_config(_config(db_dsn, broker, "node-a")))
                await tx.rollback()
            finally:
                await locker.close()
            async with await request as reply:
                status, streams = reply.status, hub.streams
            message = f"a stream of the removed token opened after the reload ({streams} open)"
            assert status != 200, message
            assert streams == 0, message
            assert status == 401
