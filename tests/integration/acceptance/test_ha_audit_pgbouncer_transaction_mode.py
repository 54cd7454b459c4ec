"""A node whose DSN goes through PgBouncer in transaction (or statement) pooling mode refuses to
start, naming the problem; through PgBouncer in session mode it runs.

In transaction mode a client connection gets a server connection for one transaction at a time:
asyncpg's prepared statements (cached per connection) are found missing on the next server, the
LISTEN connections hear nothing, and the migration's session-level advisory lock guards nothing.
The daemon used to start, answer /health 200 and log ``prepared statement "__asyncpg_stmt_…__"
does not exist`` from every loop for as long as it ran (the dispatcher, the outbox, the stream,
the alarm timers, the notification consumer). docs/deploying.md#pgbouncer says session mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import pgbouncer
from tests.support.daemon import DaemonProcess, config_toml, http_healthy
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(
    pgbouncer.available() is not None, reason=str(pgbouncer.available())
)

EXIT_CONFIG = 2
DSN_SETTING = "[database] dsn (or GATEWAY_DATABASE_DSN)"


def _node(tmp_path: Path, dsn: str, mqtt_port: int, http_port: int) -> DaemonProcess:
    path = tmp_path / "node.toml"
    path.write_text(config_toml(dsn=dsn, mqtt_port=mqtt_port, http_port=http_port))
    return DaemonProcess(path, tmp_path / "node.log")


@pytest.mark.parametrize("pool_mode", ["transaction", "statement"])
async def test_a_node_through_pgbouncer_in_transaction_mode_refuses_to_start_naming_it(
    pool_mode: str, db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    with pgbouncer.pgbouncer(db_dsn, pool_mode) as bouncer:
        node = _node(tmp_path, bouncer.dsn(), mosquitto.port, http_port)
        node.start()
        try:

            async def exited_or_healthy() -> bool:
                return not node.alive() or await http_healthy(http_port)

            await wait_until(
                exited_or_healthy, timeout=60, message=f"exited or up\n{node.log_tail(8)}"
            )
            assert not node.alive(), (
                f"the node runs through PgBouncer in {pool_mode} mode (/health 200):\n"
                f"{node.log_tail(8)}"
            )
        finally:
            node.cleanup()
    assert node.exit_code() == EXIT_CONFIG, node.log_tail()
    failed = [
        json.loads(line) for line in node.log_text().splitlines() if '"startup_failed"' in line
    ]
    assert len(failed) == 1, node.log_tail()
    assert failed[0]["setting"] == DSN_SETTING
    error = failed[0]["error"]
    assert "pool_mode = session" in error, error
    assert "transaction" in error, error
    assert "Traceback" not in node.log_text()


async def test_a_node_through_pgbouncer_in_session_mode_runs(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    with pgbouncer.pgbouncer(db_dsn, "session") as bouncer:
        node = _node(tmp_path, bouncer.dsn(), mosquitto.port, http_port)
        node.start()
        try:

            async def healthy() -> bool:
                assert node.alive(), node.log_tail()
                return await http_healthy(http_port)

            await wait_until(healthy, timeout=60, message="the node healthy through PgBouncer")
            assert node.terminate() == 0, node.log_tail()
        finally:
            node.cleanup()
    assert '"startup_failed"' not in node.log_text()
