"""A `[database] dsn` (or `GATEWAY_DATABASE_DSN`) the database driver cannot parse is found
the same way by `gateway check-config`, by `gateway run` at its start and by a reload: named,
exit 2 (the reload refused, the node running on), never its password, never a traceback.

`check-config` used to say `ok` to every one of them, and `gateway run` then refused the file
(exit 2, the node down after a deploy that checked it); one that is not even a URL to Python
(`[::1` without its `]`) ended `gateway run` and every command with a raw, non-JSON traceback
and exit 1 (restarted every 2 s), and a reload to it escaped the SIGHUP handler: no
`config_reload_refused`, and the service manager left waiting for the `READY=1` of its reload.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.acceptance.test_service_manager import NotifySocket, _process
from tests.support.daemon import config_toml, http_healthy
from tests.support.gateway_cli import gateway_run
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

PASSWORD = "Dsn-s3cret-4711"
UNPARSABLE = (
    f"postgresql://gw:{PASSWORD}@[::1/gw",
    f"postgresql://gw:{PASSWORD}@db1:notaport/gw",
    f"postgresql://gw:{PASSWORD}@db1/gw?sslmode=bogus",
    f"postgresql://gw:{PASSWORD}@db1/gw?target_session_attrs=any-one",
    f"host=db1 user=gw password={PASSWORD}",
)


def _check_config(
    path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("dsn", UNPARSABLE)
def test_check_config_refuses_a_dsn_the_driver_cannot_parse(tmp_path: Path, dsn: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(f'[database]\ndsn = "{dsn}"\n')
    done = _check_config(path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "database.dsn" in done.stderr, done.stderr
    assert "does not parse" in done.stderr, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    # From the environment, which wins over the file, the same.
    path.write_text('[database]\ndsn = "postgresql://gw@db1/gw"\n')
    done = _check_config(path, {"GATEWAY_DATABASE_DSN": dsn})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "database.dsn" in done.stderr, done.stderr
    assert PASSWORD not in done.stdout + done.stderr


def test_check_config_takes_a_failover_pair_and_a_socket_directory(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    for dsn in (
        f"postgresql://gw:{PASSWORD}@db1:5432,db2:5433/gw?target_session_attrs=read-write",
        "postgresql:///gw?host=/run/postgresql",
    ):
        path.write_text(f'[database]\ndsn = "{dsn}"\n')
        done = _check_config(path)
        assert done.returncode == 0, done.stderr


async def test_run_with_a_dsn_that_is_no_url_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[database]\ndsn = "{UNPARSABLE[0]}"\n[mqtt]\nhost = "127.0.0.1"\n'
        '[http]\nport = 0\n[log]\nformat = "json"\n'
    )
    for command in (("run",), ("migrate",)):
        done = await gateway_run(config, command=command)
        assert done.returncode == 2, done.output
        done.assert_no_traceback()
        assert PASSWORD not in done.output
        line = done.the("startup_failed")
        assert "does not parse" in line["error"], line
        assert line["setting"] == "[database] dsn (or GATEWAY_DATABASE_DSN)"


async def test_a_reload_to_an_unparsable_dsn_is_refused_and_answered(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    good = config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=http_port, log_level="info")
    async with NotifySocket(tmp_path / "notify.sock") as notify:
        process = _process(tmp_path, good, notify, watchdog_s=10.0)
        try:
            process.start()
            await wait_until(lambda: http_healthy(http_port), timeout=60, message="healthy")
            process.config_path.write_text(good.replace(db_dsn, UNPARSABLE[0]))
            process.signal(signal.SIGHUP)
            await wait_until(
                lambda: "config_reload_refused" in process.log_text() or not process.alive(),
                timeout=30,
                message="the reload refused",
            )
            # The reload is answered: READY=1 after its RELOADING=1.
            await wait_until(lambda: notify.count("READY=1") == 2, timeout=30, message="READY")
            lines = notify.lines()
            assert "READY=1" in lines[lines.index("RELOADING=1") :]
            assert await http_healthy(http_port)
            assert await asyncio.to_thread(process.terminate) == 0
        finally:
            await asyncio.to_thread(process.cleanup)
    log = process.log_text()
    assert "Traceback" not in log, log
    assert PASSWORD not in log
