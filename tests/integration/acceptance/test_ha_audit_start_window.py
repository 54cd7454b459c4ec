"""The database lost between the migration and the first batch: the start waits, it does not die.

After the pool is open and migrated, the daemon prepares its components with the database
(the rule set registered, stale rule state dropped, the crash-loop breaker's journal read).
A database restart or a failover in that window is as "merely unreachable" as one before it
(docs/operations.md#failures-and-exit-codes): the daemon must wait and retry, not exit.

The window is held open deterministically: the test locks ``node_rule_set`` (the first write
of the preparation), waits until the daemon's backend waits on that lock, and terminates it
(``pg_terminate_backend``: what a server restart or a Patroni demotion does to a connection).
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg

from gateway.runtime.daemon import Daemon
from tests.support.daemon import make_config
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

NODE = "start-window"


async def _waiting_backend(admin: asyncpg.Connection, relation: str) -> int | None:
    """The pid of the daemon's backend waiting for a lock on ``relation``, in this test's
    database (the one to terminate: not another run's node of the same name)."""
    pid = await admin.fetchval(
        "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
        "WHERE a.datname = current_database() AND a.application_name = $1 "
        "AND NOT l.granted AND l.relation = $2::regclass",
        f"gateway:{NODE}",
        relation,
    )
    return None if pid is None else int(pid)


async def test_a_connection_lost_while_the_components_are_prepared_is_waited_for(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=NODE)
    daemon = Daemon(config)
    stop = asyncio.Event()
    admin = await asyncpg.connect(db_dsn)
    locker = await asyncpg.connect(db_dsn)
    task: asyncio.Task[None] | None = None
    try:
        holding = locker.transaction()
        await holding.start()
        await locker.execute("LOCK TABLE node_rule_set IN ACCESS EXCLUSIVE MODE")
        task = asyncio.create_task(daemon.run(stop), name="daemon")
        pid: int | None = None

        async def blocked() -> bool:
            nonlocal pid
            assert not task.done(), f"the daemon ended: {task.exception()!r}"
            pid = await _waiting_backend(admin, "node_rule_set")
            return pid is not None

        await wait_until(blocked, timeout=30, message="the daemon waiting on node_rule_set")
        # The connection goes, as in a restart of the server.
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
        await holding.rollback()

        async def ready() -> bool:
            assert not task.done(), f"the daemon ended: {task.exception()!r}"
            return daemon.ready.is_set()

        await wait_until(ready, timeout=30, message="the daemon ready after the lost connection")
        healthy, body = await daemon.health()
        assert healthy, body
    finally:
        stop.set()
        if task is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(60):
                    await task
        await locker.close()
        await admin.close()
