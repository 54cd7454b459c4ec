"""A migration longer than the unit's TimeoutStartSec (120 s): converting a large telemetry
table (docs/operations.md: about 20 s per million rows), or waiting for another node's. systemd
kills a start that has not said READY=1 by then; the migration is rolled back, the unit
restarted, and the next start killed again at the same point, for ever. While it migrates, the
node must keep asking for more time (EXTEND_TIMEOUT_USEC), as long as the migration runs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg

from gateway.runtime.daemon import Daemon
from gateway.runtime.sdnotify import Notifier
from gateway.runtime.startup import MIGRATION_EXTEND_EVERY_S
from storage.migrate import MIGRATION_LOCK_KEY
from tests.integration.acceptance.test_service_manager import NotifySocket
from tests.support.daemon import make_config
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


def _extensions(notify: NotifySocket) -> list[float]:
    prefix = "EXTEND_TIMEOUT_USEC="
    return [int(line[len(prefix) :]) / 1e6 for line in notify.lines() if line.startswith(prefix)]


async def test_the_start_asks_for_more_time_while_another_node_migrates(
    empty_db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    other_node = await asyncpg.connect(empty_db_dsn)
    try:
        await other_node.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        async with NotifySocket(tmp_path / "notify.sock") as notify:
            daemon = Daemon(
                make_config(dsn=empty_db_dsn, mqtt_port=mosquitto.port, node_id="extend"),
                notifier=Notifier({"NOTIFY_SOCKET": str(notify.path)}),
            )
            stop = asyncio.Event()
            task = asyncio.create_task(daemon.run(stop))
            try:
                # Asked again and again while the migration waits: two asks, each for
                # longer than the gap to the next one.
                await wait_until(
                    lambda: len(_extensions(notify)) >= 2,
                    timeout=2 * MIGRATION_EXTEND_EVERY_S + 10,
                    message="the start asks the service manager for more time, twice",
                )
                assert all(s > MIGRATION_EXTEND_EVERY_S for s in _extensions(notify))
                assert not daemon.ready.is_set()
                # The migration ends: the node goes on to be ready, and asks no more.
                await other_node.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
                await wait_until(daemon.ready.is_set, timeout=60, message="ready")
                asked = len(_extensions(notify))
                assert notify.count("READY=1") == 1
            finally:
                stop.set()
                async with asyncio.timeout(60):
                    await task
            assert len(_extensions(notify)) == asked
    finally:
        await other_node.close()
