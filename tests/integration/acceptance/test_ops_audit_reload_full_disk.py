"""A zero-setup node (the embedded database, its admin token in the state directory) whose
state directory's disk is full still takes a `SIGHUP`: the token is read, not written again,
and the reload is applied and answered (`READY=1`).

Every reload wrote a fresh token to a temporary file before finding the one already there: on
a full disk that write failed, the `OSError` escaped the SIGHUP handler ("Exception in
callback" from asyncio), nothing was reloaded, nothing said `config_reload_refused`, and the
service manager was left waiting for the reload's `READY=1`.
"""

from __future__ import annotations

import asyncio
import errno
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from gateway.runtime.admin_token import TOKEN_FILE
from tests.integration.acceptance.test_service_manager import NotifySocket, _process
from tests.support.daemon import http_healthy
from tests.support.ports import free_port
from tests.support.waiting import wait_until


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 300 MB tmpfs of its own (not under pytest's tmp_path: the embedded server's user
    must reach it), so that filling it fills nothing else."""
    mount = Path(tempfile.mkdtemp(prefix="gw-small-disk-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=300m,mode=0755", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)
        shutil.rmtree(mount, ignore_errors=True)


def _fill(filler: Path) -> None:
    """``filler`` made to take every free byte of its disk (megabytes, then the last bytes)."""
    with filler.open("wb", buffering=0) as out:
        for size in (1 << 20, 1):
            assert _write_until_refused(out, b"\0" * size) == errno.ENOSPC


def _write_until_refused(out: BinaryIO, chunk: bytes) -> int | None:
    """The errno that ended the writes."""
    try:
        while True:
            out.write(chunk)
    except OSError as exc:
        return exc.errno


@pytest.mark.embedded
async def test_a_reload_on_a_full_state_disk_is_applied_and_answered(
    small_disk: Path, tmp_path: Path
) -> None:
    state = small_disk / "state"
    mqtt_port, http_port = free_port(), free_port()
    config = (
        f'[node]\nid = "full-disk"\nstate_dir = "{state}"\n[mqtt]\nport = {mqtt_port}\n'
        f'[http]\nport = {http_port}\n[log]\nformat = "json"\nlevel = "info"\n'
    )
    filler = small_disk / "filler"
    async with NotifySocket(tmp_path / "notify.sock") as notify:
        process = _process(tmp_path, config, notify, watchdog_s=10.0)
        try:
            process.start()
            await wait_until(lambda: http_healthy(http_port), timeout=120, message="healthy")
            assert (state / TOKEN_FILE).exists()
            await asyncio.to_thread(_fill, filler)
            process.signal(signal.SIGHUP)
            await wait_until(
                lambda: (
                    "config_reload" in process.log_text()
                    or "Exception in callback" in process.log_text()
                ),
                timeout=30,
                message="the reload done",
            )
            await wait_until(lambda: notify.count("READY=1") == 2, timeout=30, message="READY")
            lines = notify.lines()
            assert "READY=1" in lines[lines.index("RELOADING=1") :]
            assert "config_reloaded" in process.log_text(), process.log_tail()
            filler.unlink()
            assert await asyncio.to_thread(process.terminate) == 0
        finally:
            filler.unlink(missing_ok=True)
            if process.alive():  # stopped, not killed: its embedded server stops with it
                await asyncio.to_thread(process.terminate)
    log = process.log_text()
    assert "Exception in callback" not in log, log
    assert "Traceback" not in log, log
