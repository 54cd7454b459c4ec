"""A node frozen in the middle of a maintenance pass lets another node take maintenance over
within a bounded time.

A pass holds a session advisory lock for its whole length. A node whose host froze (its VM
paused, its process stopped: SIGSTOP here) keeps its TCP connection, which its kernel still
answers, and with it the lock: TCP keepalive never notices a stopped process, and every other
node skipped every pass meanwhile (no partitions made ahead, nothing pruned) until someone
killed that process. docs/operations.md, "Retention and disk".

The frozen node is a ``gateway run`` process; its pass is held deterministically on a row
lock (an expired stream ticket, which every pass deletes) until pg_stat_activity shows it
waiting there, then the process is stopped and the row released: its statement ends on the
server and its session sits idle, holding the lock. Real daemons, real PostgreSQL, real
mosquitto.
"""

from __future__ import annotations

import signal
from pathlib import Path

import asyncpg

from storage.maintenance import LOCK_HOLDER_IDLE_S, MAINTENANCE_LOCK_KEY
from tests.support.daemon import DaemonProcess, config_toml, make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

LAST_PASS = "gateway_maintenance_last_pass_timestamp_seconds"
RETENTION = "telemetry_days = 0\ninterval_s = 10"
INTERVAL_S = 10

# The frozen node's maintenance session, waiting on the test's row lock. Both views span the
# whole cluster, where other tests' daemons run their own passes under the same names: each
# query keeps to this test's database (advisory locks are per database).
WAITING = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'gateway:frozen'
  AND wait_event_type = 'Lock' AND query LIKE '%stream_ticket%'
"""
# Who holds the maintenance lock (its 64-bit key is split over classid and objid).
HOLDER = """
SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid = ($1::bigint >> 32)::oid AND objid = ($1::bigint & 4294967295)::oid
"""


async def test_a_node_frozen_mid_pass_lets_another_take_maintenance_over(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    await db.execute(
        "INSERT INTO stream_ticket (digest, token_name, role, expires_at) "
        "VALUES (sha256('held'), 'ops', 'viewer', now() - interval '1 hour')"
    )
    holder = await asyncpg.connect(db_dsn)
    held = holder.transaction()
    await held.start()
    await holder.execute("SELECT 1 FROM stream_ticket WHERE digest = sha256('held') FOR UPDATE")
    path = tmp_path / "frozen.toml"
    path.write_text(
        config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, node_id="frozen", retention=RETENTION)
    )
    frozen = DaemonProcess(path, tmp_path / "frozen.log")
    stopped = False
    try:
        frozen.start()

        async def waiting() -> int | None:
            assert frozen.alive(), frozen.log_tail()
            pid: int | None = await db.fetchval(WAITING)
            return pid

        await wait_until(waiting, timeout=60, message="the frozen node's pass on the row")
        session = await waiting()
        assert session is not None
        assert await db.fetchval(HOLDER, MAINTENANCE_LOCK_KEY) == session
        frozen.signal(signal.SIGSTOP)
        stopped = True
        await held.rollback()
        # Its DELETE ends on the server; the session now waits, idle, for a client that
        # stopped: it holds the lock.
        idle = "SELECT state = 'idle' FROM pg_stat_activity WHERE pid = $1"
        await wait_until(
            lambda: db.fetchval(idle, session),
            timeout=30,
            message="the frozen node's session idle",
        )
        assert await db.fetchval(HOLDER, MAINTENANCE_LOCK_KEY) == session

        config = make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, node_id="other", retention=RETENTION
        )
        async with running_daemon(config) as other:
            # The frozen node's session ends LOCK_HOLDER_IDLE_S after its last statement; the
            # other node's next pass (every interval_s) then runs.
            await wait_until(
                lambda: metric(other, LAST_PASS) > 0,
                timeout=LOCK_HOLDER_IDLE_S + INTERVAL_S + 20,
                message="a pass on the other node",
            )
            gone = "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $1"
            assert await db.fetchval(gone, session), "the frozen node's session ended"
            assert await db.fetchval("SELECT count(*) FROM stream_ticket") == 0
    finally:
        if not holder.is_closed():
            await holder.close()
        if stopped and frozen.alive():
            frozen.signal(signal.SIGCONT)
        frozen.cleanup()
