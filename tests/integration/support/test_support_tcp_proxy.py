"""The network-cut proxy, in front of the real PostgreSQL."""

from __future__ import annotations

import asyncio
import socket

import asyncpg
import pytest

from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

PG_HOST = "127.0.0.1"
PG_PORT = 5432


def _dsn(proxy: TcpProxy) -> str:
    return f"postgresql://postgres@127.0.0.1:{proxy.port}/test"


async def test_queries_pass_through() -> None:
    async with TcpProxy(PG_HOST, PG_PORT) as proxy:
        conn = await asyncpg.connect(_dsn(proxy))
        try:
            assert await conn.fetchval("SELECT 1") == 1
            big = await conn.fetchval("SELECT repeat('x', 1000000)")
            assert big == "x" * 1_000_000
            assert proxy.connections == 1
        finally:
            await conn.close()
        await wait_until(lambda: proxy.connections == 0, timeout=5.0, message="proxy drained")


async def test_cut_fails_open_connections_and_refuses_new_ones_until_resume() -> None:
    async with TcpProxy(PG_HOST, PG_PORT) as proxy:
        port = proxy.port
        conn = await asyncpg.connect(_dsn(proxy))
        try:
            assert await conn.fetchval("SELECT 1") == 1

            await proxy.cut()

            assert proxy.connections == 0
            # Which one depends on whether asyncpg saw the reset before or during the query.
            with pytest.raises((asyncpg.ConnectionDoesNotExistError, asyncpg.InterfaceError)):
                await conn.fetchval("SELECT 1")
        finally:
            conn.terminate()

        async with asyncio.timeout(2.0):
            with pytest.raises(ConnectionRefusedError):
                await asyncpg.connect(_dsn(proxy), timeout=5.0)

        await proxy.resume()

        assert proxy.port == port
        conn = await asyncpg.connect(_dsn(proxy))
        try:
            assert await conn.fetchval("SELECT 1") == 1
        finally:
            await conn.close()


async def test_new_connections_are_refused_at_the_tcp_level_while_cut() -> None:
    async with TcpProxy(PG_HOST, PG_PORT) as proxy:
        await proxy.cut()

        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=1.0).close()


async def test_an_unreachable_target_is_a_reset_for_the_client() -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        dead_port = placeholder.getsockname()[1]
        # Bound but not listening: connecting to it is refused.
        async with TcpProxy("127.0.0.1", dead_port) as proxy:
            with pytest.raises((OSError, asyncpg.InterfaceError)):
                await asyncpg.connect(_dsn(proxy), timeout=5.0)
            await wait_until(lambda: proxy.connections == 0, timeout=5.0, message="drained")


async def test_carries_many_concurrent_queries() -> None:
    async with TcpProxy(PG_HOST, PG_PORT) as proxy:
        pool = await asyncpg.create_pool(_dsn(proxy), min_size=8, max_size=8)
        try:

            async def worker(n: int) -> int:
                total = 0
                for i in range(500):
                    total += await pool.fetchval("SELECT $1::int", i + n)
                return total

            totals = await asyncio.gather(*(worker(n) for n in range(8)))
        finally:
            await pool.close()

    assert totals == [sum(range(n, n + 500)) for n in range(8)]
