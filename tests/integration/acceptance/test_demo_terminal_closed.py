"""``gateway demo`` whose terminal is closed (the window shut, the SSH session dropped): the
kernel sends the session a SIGHUP. The demo stops as at Ctrl-C: its devices, the daemon, its
broker and its PostgreSQL, and removes its temporary state. It used to die of the signal on the
spot, leaving its embedded PostgreSQL running (in a session of its own, so the hang-up did not
reach it) and its directory in /tmp, a server more for every demo a newcomer closed so."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.integration.acceptance.test_demo import LINE, START_TIMEOUT_S, STATE_LINE, _processes
from tests.support.waiting import wait_until_sync


@pytest.mark.embedded
def test_a_closed_terminal_stops_the_demo_as_ctrl_c_does() -> None:
    # Not under pytest's tmp_path: the embedded PostgreSQL runs as its own user.
    temp = Path(tempfile.mkdtemp(prefix="gw-demo-hup-"))
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "demo", "--http-port", "0", "--mqtt-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(temp)}, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout or ():
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        wait_until_sync(
            lambda: len(lines) >= 2 or process.poll() is not None,
            timeout=START_TIMEOUT_S,
            message="the demo's two lines",
        )
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert LINE.match(lines[0]), lines
        state = STATE_LINE.match(lines[1])
        assert state, lines
        state_dir = state["dir"]
        assert any(state_dir in cmd for _, cmd in _processes().values()), (
            "the embedded PostgreSQL runs from the demo's state directory"
        )

        process.send_signal(signal.SIGHUP)  # what a closed terminal sends
        code = process.wait(timeout=60)
        left = {
            pid: cmd
            for pid, (sid, cmd) in _processes().items()
            if sid == process.pid or state_dir in cmd
        }
        assert (code, left, Path(state_dir).exists()) == (0, {}, False), (
            "exit code, processes left, state directory left",
            process.stderr.read() if process.stderr else "",
        )
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        for pid, (_, cmd) in _processes().items():  # a PostgreSQL the demo left behind
            if str(temp) in cmd:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
