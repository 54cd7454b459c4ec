"""`[mqtt] host` is a host name or an address, nothing else: a URL (`mqtt://broker:1883`,
`tcp://user:pass@broker`), a `host:port` or a user name in it is a configuration error naming
`mqtt.host`, for `check-config`, for `gateway run` (exit 2) and for a reload (refused: the node
stays on its broker), and no message repeats a password written in it.

It used to pass `check-config`; `gateway run` then tried to resolve the whole text as a host
name, forever (`broker_unavailable`, /health 503, never exit 2), a password written in it in
every attempt's log line; and a reload to it moved a healthy node off its broker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.daemon import DaemonProcess, config_toml, http_healthy
from tests.support.gateway_cli import Finished
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

PASSWORD = "Broker-s3cret-4711"
WRONG_HOSTS = (
    "mqtt://127.0.0.1:{port}",
    "127.0.0.1:{port}",
    f"tcp://gw:{PASSWORD}@127.0.0.1",
    f"gw:{PASSWORD}@127.0.0.1",
)


def _with_host(config: str, host: str) -> str:
    return config.replace('host = "127.0.0.1"', f'host = "{host}"', 1)


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(path)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("host", WRONG_HOSTS)
def test_check_config_refuses_a_host_that_is_no_host_name(tmp_path: Path, host: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(f'[mqtt]\nhost = "{host.format(port=1883)}"\n')
    done = _check_config(path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "mqtt.host:" in done.stderr, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    # An entry of [mqtt] hosts with a user in it: refused, its password not repeated.
    path.write_text(f'[mqtt]\nhosts = ["gw:{PASSWORD}@broker:1883"]\n')
    done = _check_config(path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "mqtt.hosts[0]" in done.stderr, done.stderr
    assert PASSWORD not in done.stdout + done.stderr


def test_check_config_takes_names_and_addresses(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    for host in ("broker-1.example.net", "10.0.0.7", "::1", "fe80::1%eth0", "broker"):
        path.write_text(f'[mqtt]\nhost = "{host}"\n')
        done = _check_config(path)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("host", [WRONG_HOSTS[0], WRONG_HOSTS[2]])
async def test_run_with_a_url_as_host_ends_at_once_with_exit_2(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path, host: str
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(
        _with_host(
            config_toml(dsn=db_dsn, mqtt_port=mosquitto.port), host.format(port=mosquitto.port)
        )
    )
    process = DaemonProcess(path, tmp_path / "gateway.log")
    try:
        process.start()
        await wait_until(
            lambda: process.exit_code() is not None,
            timeout=30,
            message=f"gateway run to end; it says:\n{process.log_tail(3)}",
        )
    finally:
        await asyncio.to_thread(process.cleanup)
    done = Finished(process.exit_code() or 0, process.log_text())
    assert done.returncode == 2, done.output
    done.assert_no_traceback()
    assert done.the("config_invalid")["setting"] == "mqtt.host"
    assert PASSWORD not in done.output


async def test_a_reload_to_a_url_as_host_is_refused_and_the_node_stays_on_its_broker(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    good = config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=http_port, log_level="info")
    path = tmp_path / "gateway.toml"
    path.write_text(good)
    process = DaemonProcess(path, tmp_path / "gateway.log")
    try:
        process.start()
        await wait_until(lambda: http_healthy(http_port), timeout=60, message="healthy")
        path.write_text(_with_host(good, f"mqtt://127.0.0.1:{mosquitto.port}"))
        process.signal(signal.SIGHUP)
        await wait_until(
            lambda: "config_reload" in process.log_text(), timeout=30, message="the reload done"
        )
        assert "config_reload_refused" in process.log_text(), process.log_tail()
        # Nothing changed: the node is still on its broker (applied, the reload moved it off).
        assert await http_healthy(http_port), process.log_tail()
        assert "broker_unavailable" not in process.log_text(), process.log_tail()
        assert await asyncio.to_thread(process.terminate) == 0
    finally:
        await asyncio.to_thread(process.cleanup)
