"""The metrics that say when a node last did its periodic work read the database's clock.

An edge host with no RTC (a Raspberry Pi) boots at 1970, or at its last shutdown, and its NTP
steps the clock hours or years later, often after systemd started the gateway. The gauges
``gateway_maintenance_last_pass_timestamp_seconds`` and
``gateway_alarm_figures_sampled_timestamp_seconds`` were set from the node's wall clock: such
a node, every pass on time, said its last pass was in 1970, and the alert the operations guide
suggests (is any node's last pass recent? ``time() - max(...)``) fired; a node a year ahead
kept the maximum over the nodes a year ahead, and the alert never fired again whatever
happened to maintenance. Every other time the gateway decides by is the database's.

A real ``gateway run`` whose wall clock starts at 1970 (libfaketime: the time of day only, its
monotonic clock stays right, as when NTP has not synced yet), real PostgreSQL, real mosquitto.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from tests.support.daemon import DaemonProcess, config_toml, http_healthy, scrape
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
LAST_PASS = "gateway_maintenance_last_pass_timestamp_seconds"
SAMPLED = "gateway_alarm_figures_sampled_timestamp_seconds"
pytestmark = pytest.mark.skipif(
    not LIBFAKETIME.exists(), reason=f"{LIBFAKETIME} is missing (libfaketime: .ci/run installs it)"
)
FIGURES = """
[alarms.figures]
interval_s = 1
"""


async def test_a_node_booted_at_1970_reports_its_passes_at_the_database_time(
    db: asyncpg.Connection, db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    config = tmp_path / "pi.toml"
    config.write_text(
        config_toml(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            node_id="pi",
            http_port=http_port,
            retention="telemetry_days = 0\ninterval_s = 10",
            extra=FIGURES,
        )
    )
    env = {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": "@1970-01-01 00:00:00",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    pi = DaemonProcess(config, tmp_path / "pi.log", env)

    async def gauges() -> dict[str, float] | None:
        assert pi.alive(), f"the daemon exited:\n{pi.log_tail()}"
        if not await http_healthy(http_port):
            return None
        series = await scrape(http_port)
        if series.get(LAST_PASS, 0) > 0 and series.get(SAMPLED, 0) > 0:
            return series
        return None

    try:
        pi.start()
        await wait_until(gauges, timeout=60, message="a maintenance pass and a figures sample")
        series = await gauges()
        assert series is not None
        database_now: float = await db.fetchval("SELECT extract(epoch FROM now())::float8")
    finally:
        pi.terminate()
        pi.cleanup()
    assert "maintenance_clock_skew" in pi.log_text()  # the node's clock was 1970 indeed
    assert abs(series[LAST_PASS] - database_now) < 60, (series[LAST_PASS], database_now)
    assert abs(series[SAMPLED] - database_now) < 60, (series[SAMPLED], database_now)
