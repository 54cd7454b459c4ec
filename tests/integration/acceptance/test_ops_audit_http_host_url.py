"""`[http] host` is an address or a host name to listen on, nothing else: a URL
(`http://0.0.0.0`) or a `host:port` is a configuration error naming `http.host`, for
`check-config` and for `gateway run` (exit 2: the units do not restart it).

It used to pass `check-config`, and `gateway run` ended with exit 1 ("cannot listen on
http://0.0.0.0:8080: Name or service not known"), which `Restart=on-failure` restarted every
2 s until systemd's start limit gave up on the unit.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.daemon import config_toml
from tests.support.gateway_cli import gateway_run
from tests.support.mosquitto import Mosquitto


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("host", ["http://0.0.0.0", "0.0.0.0:8080", "[::1]"])
async def test_a_url_or_port_in_http_host_is_a_configuration_error(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path, host: str
) -> None:
    path = tmp_path / "gateway.toml"
    config = config_toml(dsn=db_dsn, mqtt_port=mosquitto.port)
    path.write_text(config.replace("[http]\n", f'[http]\nhost = "{host}"\n', 1))
    checked = await asyncio.to_thread(_check_config, path)
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "http.host:" in checked.stderr, checked.stderr
    done = await gateway_run(path)
    assert done.returncode == 2, done.output
    done.assert_no_traceback()
    assert done.the("config_invalid")["setting"] == "http.host"


def test_addresses_and_names_to_listen_on_are_taken(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    everywhere = "0.0.0.0"  # noqa: S104 - listening everywhere is what is checked
    for host in (everywhere, "::", "::1", "127.0.0.1", "localhost", "gw-1.example.net"):
        path.write_text(f'[http]\nhost = "{host}"\n')
        checked = _check_config(path)
        assert checked.returncode == 0, checked.stderr
