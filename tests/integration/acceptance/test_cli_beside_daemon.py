"""The CLI beside a running zero-setup daemon: it uses the daemon's embedded PostgreSQL."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import aiomqtt
import asyncpg
import pytest

from gateway.embedded.postgres import EmbeddedPostgres
from protocol import Topics
from tests.support.daemon import DaemonProcess, count_rows, http_healthy
from tests.support.ports import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.embedded

TOPICS = Topics("iot")

RULES = """
[[rules]]
key = "hot"
kind = "threshold"
severity = "MAJOR"
metric = "temp"
op = ">"
value = 30

[[rules]]
key = "damp"
kind = "threshold"
severity = "WARNING"
metric = "humidty"
op = ">"
value = 80

[[rules]]
key = "door"
kind = "event"
severity = "MAJOR"
event = "DOOR_OPNE"
"""


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path: the embedded server's user must reach it.
    path = Path(tempfile.mkdtemp(prefix="gw-cli-state-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_commands_use_the_running_daemons_embedded_database(
    state_dir: Path, tmp_path: Path
) -> None:
    mqtt_port, http_port = free_port(), free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[node]\nstate_dir = "{state_dir}"\n'
        f"[mqtt]\nport = {mqtt_port}\n[http]\nport = {http_port}\n"
        f'[log]\nformat = "json"\n{RULES}'
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        process.start()

        async def healthy() -> bool:
            assert process.alive(), f"daemon exited:\n{process.log_tail()}"
            return await http_healthy(http_port)

        await wait_until(healthy, timeout=90, message="daemon healthy")
        dsn = EmbeddedPostgres(state_dir).dsn

        # embedded-db prints the running server's DSN and returns (it does not fail, nor wait).
        printed = _gateway("embedded-db", "--config", str(config))
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout.strip() == dsn
        assert "Traceback" not in printed.stderr

        migrated = _gateway("migrate", "--config", str(config))
        assert migrated.returncode == 0, migrated.stderr
        assert "up to date" in migrated.stdout

        async with aiomqtt.Client("127.0.0.1", mqtt_port) as pub:
            await pub.publish(
                TOPICS.telemetry("dev-1"),
                json.dumps(
                    {
                        "ts": int(time.time() * 1000),
                        "metrics": {"temp": 21.5, "humidity": 40},
                        "events": [{"type": "DOOR_OPEN"}],
                    }
                ).encode(),
                qos=1,
            )
            await pub.publish(TOPICS.telemetry("dev-1"), b"not json", qos=1)

        async def stored() -> bool:
            return await count_rows(dsn) == 1 and await count_rows(dsn, "dead_letter") == 1

        await wait_until(stored, timeout=30, message="telemetry and a dead letter stored")

        listing = _gateway("dead-letters", "list", "--config", str(config), "--json")
        assert listing.returncode == 0, listing.stderr
        (letter,) = [json.loads(line) for line in listing.stdout.splitlines()]
        assert letter["reason"] == "MALFORMED"

        # The misspelled rules are named, with the closest names seen in the window.
        check = _gateway("rules", "check", "--config", str(config), "--since", "2h")
        assert check.returncode == 1, check.stderr
        lines = check.stdout.splitlines()
        assert any("'damp'" in line and "closest seen: humidity" in line for line in lines)
        assert any("'door'" in line and "closest seen: DOOR_OPEN" in line for line in lines)
        assert not any("'hot'" in line for line in lines)
        assert "2 of 3 rules" in check.stdout

        # The zero-setup admin token: created on first start, private, and it works.
        token_file = state_dir / "admin-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        async with (
            aiohttp.ClientSession() as http,
            http.get(
                f"http://127.0.0.1:{http_port}/alarms",
                headers={"Authorization": f"Bearer {token}"},
            ) as response,
        ):
            assert response.status == 200, await response.text()
        assert process.terminate() == 0
    finally:
        process.cleanup()
    log = process.log_text()
    assert str(token_file) in log  # the daemon said where the token is...
    assert token not in log  # ...never what it is
    assert '"admin_token_created"' in log

    # With the daemon gone, a command starts (and stops) a server of its own.
    alone = _gateway("migrate", "--config", str(config))
    assert alone.returncode == 0, alone.stderr
    assert "up to date" in alone.stdout
    assert not (state_dir / "pgdata" / "postmaster.pid").exists()
    conn_dsn = EmbeddedPostgres(state_dir).dsn
    with pytest.raises((OSError, asyncpg.PostgresError)):
        await asyncpg.connect(conn_dsn, timeout=5)
