"""The embedded server's recorded address: what a second process finds while the owner runs."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from gateway.embedded.postgres import (
    EmbeddedPostgres,
    EmbeddedPostgresBusyError,
    RunningServer,
    running_dsn,
)
from tests.support.waiting import wait_until_sync

pytestmark = pytest.mark.embedded

PROJECT_ROOT = Path(__file__).resolve().parents[3]

# An owner in another process: starts the server, says so, stops it when stdin closes.
OWNER_SCRIPT = """
import sys
from pathlib import Path
from gateway.embedded.postgres import EmbeddedPostgres
server = EmbeddedPostgres(Path(sys.argv[1]))
print("DSN " + server.start(), flush=True)
sys.stdin.read()
server.stop()
print("STOPPED", flush=True)
"""


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path: the server's own user must reach it (see test_embedded_pg).
    root = Path(tempfile.mkdtemp(prefix="gw-pgaddr-"))
    try:
        yield root / "state"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _owner(state_dir: Path) -> tuple[subprocess.Popen[str], str]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, str(state_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=PROJECT_ROOT,
    )
    assert owner.stdout is not None
    seen = []
    # Blocks until the server is up (or the owner died); its log lines come first.
    for line in owner.stdout:
        if line.startswith("DSN "):
            return owner, line.split(" ", 1)[1].strip()
        seen.append(line)
    owner.wait(timeout=30)
    raise AssertionError(f"owner failed: {''.join(seen)}")


async def test_a_second_process_finds_the_running_server_and_no_longer_once_stopped(
    state_dir: Path,
) -> None:
    assert running_dsn(state_dir) is None  # nothing there at all
    owner, dsn = _owner(state_dir)
    try:
        found = running_dsn(state_dir)
        assert found == RunningServer(pid=owner.pid, dsn=dsn)
        conn = await asyncpg.connect(found.dsn)
        try:
            assert await conn.fetchval("SELECT current_database()") == "gateway"
        finally:
            await conn.close()
        # Starting a second server on the same cluster is refused, and says why.
        with pytest.raises(EmbeddedPostgresBusyError, match=r"pg\.lock is locked"):
            EmbeddedPostgres(state_dir).start()
        assert owner.stdin is not None
        owner.stdin.close()
        assert owner.stdout is not None
        assert "STOPPED" in owner.stdout.read()
        assert owner.wait(timeout=60) == 0
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=30)
    assert running_dsn(state_dir) is None
    assert (state_dir / "pg.lock").read_bytes() == b""  # the record went with the server


async def test_a_record_left_by_a_killed_owner_is_ignored(state_dir: Path) -> None:
    owner, dsn = _owner(state_dir)
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=30)
    assert owner.stdout is not None
    owner.stdout.close()
    # The record is still in the file, but nobody holds the lock: it means nothing.
    assert json.loads((state_dir / "pg.lock").read_text())["dsn"] == dsn
    assert running_dsn(state_dir) is None
    # The next owner stops the orphaned server, starts its own and records itself.
    server = EmbeddedPostgres(state_dir)
    try:
        assert server.start() == dsn
        found = running_dsn(state_dir)
        assert found is not None
        assert found.pid == os.getpid()
    finally:
        server.stop()


def test_an_owner_still_starting_is_waited_for_then_named(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    lock_file = state_dir / "pg.lock"
    with lock_file.open("ab") as held:
        # Locked, nothing recorded yet: an owner in the middle of initdb.
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(EmbeddedPostgresBusyError, match="being started by another process"):
            running_dsn(state_dir, wait_s=0.2)
        # It records its address: a reader waiting for it gets it.
        held.write(json.dumps({"pid": 4242, "dsn": "postgresql://x@/gateway"}).encode())
        held.flush()
        wait_until_sync(
            lambda: running_dsn(state_dir, wait_s=5) is not None, timeout=10, message="found"
        )
        assert running_dsn(state_dir) == RunningServer(4242, "postgresql://x@/gateway")
