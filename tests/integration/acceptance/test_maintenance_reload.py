"""A reload (SIGHUP) that changes [retention] is followed by the next maintenance pass.

The daemon read [retention] at start only, and said nothing at a reload that changed it
(``config_reloaded``, as for any reload): an operator who raised ``dead_letter_days`` (or
``telemetry_days``) to keep what an investigation needs, and reloaded, had those rows pruned
by the next pass under the old setting. Real daemon, real mosquitto, real PostgreSQL."""

from __future__ import annotations

import asyncpg

from gateway.config import Config
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

LAST_PASS = "gateway_maintenance_last_pass_timestamp_seconds"


def _config(dsn: str, port: int, dead_letter_days: int) -> Config:
    return make_config(
        dsn=dsn,
        mqtt_port=port,
        retention=f"telemetry_days = 0\ndead_letter_days = {dead_letter_days}\ninterval_s = 10",
    )


async def test_a_retention_setting_raised_by_a_reload_keeps_the_rows_at_the_next_pass(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    async with running_daemon(_config(db_dsn, mosquitto.port, 30)) as daemon:
        await wait_until(lambda: metric(daemon, LAST_PASS) > 0, timeout=60, message="1st pass")
        # The operator keeps dead letters 90 days now (an investigation needs last month's).
        daemon.reload(_config(db_dsn, mosquitto.port, 90))
        reloaded_after = metric(daemon, LAST_PASS)
        await db.execute(
            "INSERT INTO dead_letter (topic, payload, payload_size, payload_sha256, reason, "
            "detail, node_id, received_at, last_seen_at) VALUES ('t', 'x', 1, "
            "encode(sha256('x'), 'hex'), 'INVALID', 'bad', 'n1', now() - interval '40 days', "
            "now() - interval '40 days')"
        )
        await wait_until(
            lambda: metric(daemon, LAST_PASS) > reloaded_after,
            timeout=60,
            message="a pass after the reload",
        )
        assert await db.fetchval("SELECT count(*) FROM dead_letter") == 1
