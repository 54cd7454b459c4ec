"""The database host goes silent (no FIN, no reset: power, a partition) while the node waits
for the migration. The migration's calls have no practical time bound (a conversion may take
many minutes), so nothing but a probe of the server notices: the node must give that
connection up, connect again once the server answers, and start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg

from gateway.config import parse_config
from gateway.runtime.daemon import Daemon
from gateway.runtime.startup import MIGRATION_EXTEND_EVERY_S
from storage.migrate import MIGRATION_LOCK_KEY, latest_version, schema_version
from tests.support.daemon import config_toml
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

NODE = "silent-migration"


@dataclass
class _Waiting:
    other_node: asyncpg.Connection  # holds the migration lock
    proxy: TcpProxy  # between the node and its database
    daemon: Daemon
    stop: asyncio.Event
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def _node_waiting_for_the_migration(
    empty_db_dsn: str, mosquitto: Mosquitto
) -> AsyncIterator[_Waiting]:
    """A node started through a proxy while another holds the migration lock, once its
    migration waits for that lock; stopped on the way out (within 60 s, or the test fails)."""
    other_node = await asyncpg.connect(empty_db_dsn)
    proxy = proxy_for(empty_db_dsn)
    await proxy.start()
    try:
        await other_node.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        config = config_toml(
            dsn=through(empty_db_dsn, proxy), mqtt_port=mosquitto.port, node_id=NODE
        ).replace("[database]\n", "[database]\nconnect_timeout_s = 2\n")
        daemon = Daemon(parse_config(config))
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop))
        try:

            async def waiting() -> bool:
                return bool(
                    await other_node.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND application_name = $1 AND wait_event_type = 'Lock'",
                        f"gateway:{NODE}",
                    )
                )

            await wait_until(waiting, timeout=30, message="waits")
            yield _Waiting(other_node, proxy, daemon, stop, task)
        finally:
            stop.set()
            done, _ = await asyncio.wait({task}, timeout=60)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise AssertionError("the node did not stop within 60 s")
            await task
    finally:
        await proxy.stop()
        await other_node.close()


async def test_a_host_gone_silent_during_the_migration_wait_is_given_up_and_the_node_starts(
    empty_db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with _node_waiting_for_the_migration(empty_db_dsn, mosquitto) as at:
        # The link dies silently; the backends behind it go on (one waiting for the lock).
        # This database's only: the other test here runs a node of the same name elsewhere.
        cut_off = await at.other_node.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = $1",
            f"gateway:{NODE}",
        )
        at.proxy.black_hole()
        retries = at.daemon.metrics.db_retries._value.get()
        await wait_until(
            lambda: at.daemon.metrics.db_retries._value.get() > retries,
            timeout=2 * MIGRATION_EXTEND_EVERY_S + 15,
            message="the node gives the silent connection up",
        )
        # The link is back (new connections); the server drops the backends of the dead
        # link (as its TCP keepalive would, in time); the other node ends its migration.
        at.proxy.swallowing = False
        await at.other_node.execute(
            "SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid",
            [row["pid"] for row in cut_off],
        )
        await at.other_node.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
        await wait_until(at.daemon.ready.is_set, timeout=60, message="ready")
        assert await schema_version(at.other_node) == latest_version()


async def test_a_stop_after_the_host_went_silent_during_the_migration_wait_is_prompt(
    empty_db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with _node_waiting_for_the_migration(empty_db_dsn, mosquitto) as at:
        at.proxy.black_hole()
        at.stop.set()
        done, _ = await asyncio.wait({at.task}, timeout=15)
        assert done, "still starting 15 s after the stop"
        at.task.result()
