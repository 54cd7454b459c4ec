"""An older release started against a schema a newer one migrated refuses, as a configuration
to fix (exit 2: the systemd units do not restart it), saying what to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import asyncpg

from storage.migrate import latest_version
from tests.support.newer_release import migrate_as_newer_release
from tests.support.ports import free_port


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_an_older_release_refuses_to_start_on_a_newer_schema_as_a_configuration_error(
    db_dsn: str, tmp_path: Path
) -> None:
    newer = await migrate_as_newer_release(db_dsn)
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[database]\ndsn = "{db_dsn}"\n[mqtt]\nhost = "127.0.0.1"\nport = {free_port()}\n'
        '[http]\nenabled = false\n[log]\nformat = "json"\n'
    )
    for command in (("run",), ("migrate",)):
        result = _gateway(*command, "--config", str(config))
        # Exit 1 was restarted by Restart=on-failure every 2 s for as long as the node was
        # not upgraded: the same release refuses the same schema every time.
        assert result.returncode == 2, (command, result.returncode, result.stderr)
        (line,) = [json.loads(text) for text in result.stderr.splitlines() if text.strip()]
        assert line["event"] == "startup_failed", line
        assert f"at version {newer}" in line["error"], line
        assert f"up to {latest_version()} only" in line["error"], line
        assert "install the new release on this node" in line["error"], line
        assert "release" in line["setting"], line


async def test_a_changed_migration_file_refuses_the_start_as_final(
    db_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    """An applied migration whose shipped file differs (a release built from edited
    migrations, a hand-patched install): every start refuses it alike, so a restart cannot
    help. It exited 1, restarted by Restart=on-failure every 2 s for good."""
    # This database holds the shipped migrations (the fixture migrated it): one recorded as
    # applied with other contents is what a changed file shows.
    await db.execute("UPDATE schema_migration SET checksum = 'edited' WHERE version = 1")
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[database]\ndsn = "{db_dsn}"\n[mqtt]\nhost = "127.0.0.1"\nport = {free_port()}\n'
        '[http]\nenabled = false\n[log]\nformat = "json"\n'
    )
    for command in (("run",), ("migrate",)):
        result = _gateway(*command, "--config", str(config))
        assert result.returncode == 2, (command, result.returncode, result.stderr)
        (line,) = [json.loads(text) for text in result.stderr.splitlines() if text.strip()]
        assert line["event"] == "startup_failed", line
        assert "different contents" in line["error"], line
        assert "release" in line["setting"], line
