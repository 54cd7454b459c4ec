"""A multi-host DSN whose first host went silent: the node reaches the second one.

docs/deploying.md: the DSN names both database hosts (``db1:5432,db2:5432/gateway
?target_session_attrs=read-write``) and every connection goes to the primary. When the old
primary's host dies without a reset (power, a partition, a cloud instance stopped: the SYNs go
unanswered), asyncpg spends the whole connect timeout (``[database] connect_timeout_s``,
10 s) on the first host, for all of them together, and never tries the second: the node waits
for a database that is up. libpq gives each host its own timeout.

The silent host is a TCP proxy that accepts and answers nothing; the second host is the test's
PostgreSQL.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit

import msgspec

from gateway.runtime.daemon import Daemon
from tests.support.daemon import make_config
from tests.support.dsn import proxy_for
from tests.support.mosquitto import Mosquitto

CONNECT_TIMEOUT_S = 2.0


def _silent_first(dsn: str, silent_port: int) -> str:
    parts = urlsplit(dsn)
    user = parts.username or "postgres"
    hosts = f"127.0.0.1:{silent_port},{parts.hostname or '127.0.0.1'}:{parts.port or 5432}"
    return urlunsplit(
        ("postgresql", f"{user}@{hosts}", parts.path, "target_session_attrs=read-write", "")
    )


async def test_a_node_whose_first_database_host_is_silent_uses_the_second(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    # In front of the real server, carrying nothing either way: a host that answers nothing.
    async with proxy_for(db_dsn) as silent:
        silent.black_hole()
        config = make_config(
            dsn=_silent_first(db_dsn, silent.port), mqtt_port=mosquitto.port, node_id="second"
        )
        config = msgspec.structs.replace(
            config,
            database=msgspec.structs.replace(config.database, connect_timeout_s=CONNECT_TIMEOUT_S),
        )
        daemon = Daemon(config)
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop), name="daemon")
        try:
            ready = asyncio.ensure_future(daemon.ready.wait())
            await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            assert not task.done(), repr(task.exception())
            assert daemon.ready.is_set(), f"not ready after 30 s: {daemon.starting}"
            healthy, body = await daemon.health()
            assert healthy, body
        finally:
            stop.set()
            await asyncio.wait({task}, timeout=60)
