"""After the database host went silent, the node's LISTEN connections open again on the next one.

docs/deploying.md: every LISTEN connection (the command dispatcher, campaigns, the outbox
publisher, the stream hub, the notification consumer and workers) "open[s] again after a loss".
A killed server resets them, and they do; a host gone silent (power, a partition: nothing reset)
leaves them open on a dead link, idle, so nothing ever noticed: the pool moved to the promoted
second host, but the loops waited for notifications that could not come, polling instead, for
the rest of the process's life (realtime commands dispatched, alarms pushed, streams fed a poll
late, up to 5 s for campaigns). A loop's pass that fails on the database now cuts its LISTEN
connection, which is opened again at once, through the same DSN.

A multi-host DSN whose first host is a TCP proxy to the test's PostgreSQL, and the second host
the server itself; the proxy then forwards nothing, either way. The old LISTEN backends stay on
the server behind the silent proxy while the node keeps its end: new LISTEN backends are the
proof.
"""

from __future__ import annotations

import asyncio

import asyncpg
import msgspec
import pytest

from gateway.runtime.daemon import Daemon
from tests.integration.acceptance.test_ha_audit_silent_first_host import _silent_first
from tests.support.daemon import make_config
from tests.support.dsn import proxy_for
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

CONNECT_TIMEOUT_S = 2.0
# The command dispatcher, campaigns, the outbox publisher, the stream hub, the notification
# consumer and its delivery workers.
LOOPS = 6
# The pool's command timeout (60 s) ends the loops' passes on the silent host first.
REOPENED_WITHIN_S = 60 + 40

pytestmark = pytest.mark.slow  # the pool's command timeout runs out first: about 70 s


async def _listening(conn: asyncpg.Connection) -> set[int]:
    """The backends (pids) LISTENing in the test's database."""
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity "
        "WHERE datname = current_database() AND query LIKE 'LISTEN %'"
    )
    return {row["pid"] for row in rows}


async def test_listen_connections_open_again_after_the_first_host_went_silent(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    admin = await asyncpg.connect(db_dsn)
    try:
        async with proxy_for(db_dsn) as first:
            config = make_config(
                dsn=_silent_first(db_dsn, first.port), mqtt_port=mosquitto.port, node_id="lsn"
            )
            config = msgspec.structs.replace(
                config,
                database=msgspec.structs.replace(
                    config.database, connect_timeout_s=CONNECT_TIMEOUT_S
                ),
            )
            daemon = Daemon(config)
            stop = asyncio.Event()
            task = asyncio.create_task(daemon.run(stop), name="daemon")
            try:
                ready = asyncio.ensure_future(daemon.ready.wait())
                await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
                assert daemon.ready.is_set(), f"not ready: {daemon.starting}"

                async def all_listening() -> bool:
                    return len(await _listening(admin)) >= LOOPS

                await wait_until(all_listening, timeout=30, message="six LISTEN connections")
                before = await _listening(admin)
                first.black_hole()

                async def reopened() -> bool:
                    assert not task.done(), repr(task.exception())
                    return len(await _listening(admin) - before) >= LOOPS

                await wait_until(
                    reopened,
                    timeout=REOPENED_WITHIN_S,
                    interval=0.5,
                    message=f"the {LOOPS} LISTEN connections opened again on the second host",
                )
            finally:
                stop.set()
                await asyncio.wait({task}, timeout=60)
    finally:
        await admin.close()
