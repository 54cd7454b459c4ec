"""A LISTEN connection on a database host gone silent moves to a host that answers.

The command dispatcher, campaigns, the outbox publisher, the stream hub and the notification
consumer each keep a connection that LISTENs, and poll as a fallback. A LISTEN connection
idles: a host gone silent under it (power, a partition, a failover whose old primary's machine
stays unreachable: nothing reset) was never noticed there, and the loop polled for the rest of
the process's life (every 1 s for the dispatcher, on every node; docs/deploying.md, "What the
gateway does during a failover"). The listener now asks a silent connection once, and cuts it
when no answer comes.

Real PostgreSQL behind two TCP proxies, the two hosts of a multi-host DSN: the first one goes
silent (it keeps every connection open and forwards nothing, either way), the second answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from gateway.support.loops import Listener
from tests.support.dsn import proxy_for
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

CHANNEL = "listen_audit_silent"


def two_hosts(dsn: str, first: TcpProxy, second: TcpProxy) -> str:
    parts = urlsplit(dsn)
    user = parts.username or "postgres"
    hosts = f"127.0.0.1:{first.port},127.0.0.1:{second.port}"
    return urlunsplit(("postgresql", f"{user}@{hosts}", parts.path, "", ""))


async def woken_by_a_notify(db: asyncpg.Connection, wakeup: asyncio.Event) -> None:
    """A NOTIFY on the channel, sent from another connection, reaches the listener."""
    wakeup.clear()
    await db.execute(f"NOTIFY {CHANNEL}")
    async with asyncio.timeout(10):
        await wakeup.wait()


@asynccontextmanager
async def hosts(db_dsn: str) -> AsyncIterator[tuple[TcpProxy, TcpProxy, str]]:
    silent, spare = proxy_for(db_dsn), proxy_for(db_dsn)
    await silent.start()
    await spare.start()
    try:
        yield silent, spare, two_hosts(db_dsn, silent, spare)
    finally:
        await silent.stop()
        await spare.stop()


async def test_a_listen_connection_whose_host_went_silent_is_opened_on_the_next(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    async with hosts(db_dsn) as (silent, spare, dsn):
        wakeup = asyncio.Event()
        listener = Listener(
            dsn, CHANNEL, wakeup, "test", probe_s=0.5, probe_timeout_s=1.0, connect_timeout_s=2.0
        )
        try:
            await listener.ensure()
            assert listener.listening
            assert (silent.connections, spare.connections) == (1, 0)
            wakeup.clear()
            silent.black_hole()

            async def moved() -> bool:
                await listener.ensure()
                return listener.listening and spare.connections == 1

            await wait_until(moved, timeout=30, message="the LISTEN connection on the next host")
            await woken_by_a_notify(db, wakeup)
        finally:
            await listener.close()


async def test_a_connection_that_answers_is_kept(db_dsn: str, db: asyncpg.Connection) -> None:
    """The probe costs one question per quiet period, and a server that answers keeps its
    connection (no reconnects, no notification lost between two connections)."""
    async with hosts(db_dsn) as (silent, spare, dsn):
        wakeup = asyncio.Event()
        listener = Listener(dsn, CHANNEL, wakeup, "test", probe_s=0.2)
        try:
            await listener.ensure()
            first = listener.connection
            heard: list[float] = [listener.heard_at]
            assert listener.wait_s(3600.0) <= 0.2

            async def probed() -> bool:
                await listener.ensure()
                if listener.heard_at != heard[-1]:
                    heard.append(listener.heard_at)
                return len(heard) >= 4

            await wait_until(probed, timeout=30, message="three probes answered")
            assert listener.connection is first
            assert (silent.connections, spare.connections) == (1, 0)
            await woken_by_a_notify(db, wakeup)
        finally:
            await listener.close()
