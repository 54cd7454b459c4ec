"""A systemd credential (`$CREDENTIALS_DIRECTORY/mqtt_password`, `database_dsn`) that is not
UTF-8 (a password with an accent saved as Latin-1): a configuration error naming the key, as
an unset variable is, at check-config, at start and at a reload. It was a UnicodeDecodeError
traceback: check-config crashed, `gateway run` died at every restart, and at a SIGHUP the
exception escaped the reload (no `config_reload_refused`, no READY=1 after RELOADING=1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.daemon import DaemonProcess, config_toml, http_healthy
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

LATIN1 = "café".encode("latin-1")


def test_check_config_names_a_credential_that_is_not_utf8(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "mqtt_password").write_bytes(LATIN1)
    config = tmp_path / "gateway.toml"
    config.write_text('[mqtt]\nhost = "127.0.0.1"\n')
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "CREDENTIALS_DIRECTORY": str(credentials)},
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    assert "mqtt.password" in done.stderr, done.stderr


async def test_a_reload_with_a_credential_that_is_not_utf8_is_refused(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    password = credentials / "mqtt_password"
    password.write_text("cafe")  # mosquitto here takes any password
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=http_port, log_level="info")
    )
    process = DaemonProcess(
        config, tmp_path / "daemon.log", env={"CREDENTIALS_DIRECTORY": str(credentials)}
    )
    try:
        process.start()

        async def healthy() -> bool:
            assert process.alive(), process.log_tail()
            return await http_healthy(http_port)

        await wait_until(healthy, timeout=60, message="daemon healthy")
        password.write_bytes(LATIN1)
        process.signal(signal.SIGHUP)

        def answered() -> bool:
            text = process.log_text()
            return "config_reload" in text or "UnicodeDecodeError" in text

        await wait_until(answered, timeout=30, message="the reload answered")
        text = process.log_text()
        assert "UnicodeDecodeError" not in text, process.log_tail()
        assert "config_reload_refused" in text, process.log_tail()
        assert "mqtt.password" in text
        assert await http_healthy(http_port)
        assert process.terminate() == 0
    finally:
        process.cleanup()
