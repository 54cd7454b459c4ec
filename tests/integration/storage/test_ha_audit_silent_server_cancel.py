"""A call on a connection whose server went silent gives up after the command timeout, once.

docs/deploying.md: "a statement on one waits until the pool's command timeout (60 s) before the
connection is dropped". asyncpg then sends a cancel request, on a new connection to the same
server, and waits for it, bounded by the command timeout again, before the connection is let go:
a server gone silent (power, a partition: nothing reset) answers neither, so every call in
flight there (an ingest batch, each loop's pass) held its pool connection for twice the command
timeout. Measured with a node: ingest resumed on the promoted second host 130 s after the first
went silent. The cancel request now has the connect timeout, after which the connection is cut.

The server goes silent through a TCP proxy that forwards nothing either way (the cancel
request's own connection included).
"""

from __future__ import annotations

import time

import pytest

from storage.pool import create_pool
from tests.support.dsn import proxy_for, through

COMMAND_TIMEOUT_S = 8.0
CONNECT_TIMEOUT_S = 1.0


async def test_a_call_on_a_silent_server_lets_its_connection_go_after_the_command_timeout(
    db_dsn: str,
) -> None:
    async with proxy_for(db_dsn) as proxy:
        pool = await create_pool(
            through(db_dsn, proxy), min_size=1, max_size=1,
            connect_timeout_s=CONNECT_TIMEOUT_S, command_timeout_s=COMMAND_TIMEOUT_S,
        )  # fmt: skip
        try:
            async with pool.acquire() as conn:
                assert await conn.fetchval("SELECT 1") == 1
            proxy.black_hole()
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                async with pool.acquire() as conn:
                    await conn.fetchval("SELECT 1")
            took = time.monotonic() - started
        finally:
            pool.terminate()
    print(f"\nsilent server: the call gave its connection back after {took:.1f} s")
    assert took < COMMAND_TIMEOUT_S + CONNECT_TIMEOUT_S + 3, (
        f"the call and the release of its connection took {took:.1f} s "
        f"(command timeout {COMMAND_TIMEOUT_S:.0f} s)"
    )
