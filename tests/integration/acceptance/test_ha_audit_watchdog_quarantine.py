"""A database that holds the writer past the watchdog, twice: the message waits, it is not
quarantined.

supervision.py: a database write stuck for longer than the watchdog period withholds the pings
and systemd restarts the service, "nothing is lost: unacknowledged messages are redelivered".
The crash-loop breaker (breaker.py) counts a death for each message in flight when a node died,
and quarantines a message (a dead letter, acknowledged, never stored) at two deaths in a row.
A lock held on the database for a few minutes (a non-concurrent CREATE INDEX, a VACUUM FULL, a
long migration of another node) stops every node's writer the same way, whatever the message:
two watchdog restarts then quarantine healthy telemetry.

Here the service manager is the test: it reads the daemon's sd_notify datagrams and, when the
pings stop, kills the process and starts it again. The database lock is a SHARE lock on the
device table, which every telemetry insert updates (``last_seen``).
"""

from __future__ import annotations

from pathlib import Path

import aiomqtt
import asyncpg

from protocol import Topics
from tests.integration.acceptance.test_service_manager import NotifySocket
from tests.support.daemon import DaemonProcess, config_toml, count_rows
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
WATCHDOG_S = 1.0


async def test_watchdog_restarts_while_the_database_holds_a_write_quarantine_nothing(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=free_port()))
    log = tmp_path / "daemon.log"
    blocker = await asyncpg.connect(db_dsn)
    processes: list[DaemonProcess] = []
    async with NotifySocket(tmp_path / "notify.sock") as notify:
        env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}

        def start() -> DaemonProcess:
            process = DaemonProcess(path, log, env=env)
            processes.append(process)
            process.start()
            return process

        def withheld() -> int:
            return log.read_text(errors="replace").count('"watchdog_withheld"')

        try:
            process = start()
            await wait_until(lambda: notify.count("READY=1") >= 1, timeout=60, message="ready")
            await blocker.execute("BEGIN; LOCK TABLE device IN SHARE MODE")
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
                await pub.publish(
                    TOPICS.telemetry("d1"), b'{"ts": 1767225600000, "metrics": {"t": 1}}', qos=1
                )
            # The service manager: the pings stop, it kills the node and starts it again; twice.
            for restart in (1, 2):
                await wait_until(
                    lambda restart=restart: withheld() >= restart,
                    timeout=60,
                    message=f"the pings withheld ({restart})",
                )
                process.kill()
                process = start()
                await wait_until(
                    lambda restart=restart: notify.count("READY=1") >= restart + 1,
                    timeout=60,
                    message=f"ready again ({restart})",
                )
            # The lock is released: the message is stored, as if nothing had happened.
            await blocker.execute("ROLLBACK")

            async def settled() -> bool:
                assert process.alive(), process.log_tail()
                letters = await blocker.fetchval("SELECT count(*) FROM dead_letter")
                return bool(letters) or await count_rows(db_dsn) == 1

            await wait_until(settled, timeout=60, message="the message stored or dead-lettered")
            letters = await blocker.fetch("SELECT reason, detail FROM dead_letter")
            assert [tuple(r) for r in letters] == []
            assert await count_rows(db_dsn) == 1
            assert process.terminate() == 0
        finally:
            await blocker.close()
            for each in processes:
                each.cleanup()
