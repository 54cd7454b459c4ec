"""``gateway demo`` as a newcomer runs it: one line with the console's address and a token,
alarms from the simulated devices within seconds, commands answered, and Ctrl-C leaves
nothing running (no child, no PostgreSQL, no temporary state)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.demo.run import CHROMIUM
from tests.support.ports import free_port
from tests.support.waiting import wait_until_sync

LINE = re.compile(
    r"^Gateway demo: open (?P<url>http://\S+/) and sign in with the token (?P<token>\S+) "
)
START_TIMEOUT_S = 120.0


def _processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (session id, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found[int(entry.name)] = (os.getsid(int(entry.name)), cmdline)
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile
    return found


@pytest.fixture
def tmpdir_for_demo() -> Iterator[Path]:
    # Not under pytest's tmp_path (mode 0700 reset by concurrent runs): the embedded
    # PostgreSQL runs as its own user and must reach the state directory.
    path = Path(tempfile.mkdtemp(prefix="gw-demo-test-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.embedded
def test_the_demo_prints_one_line_serves_the_console_and_stops_cleanly(
    tmpdir_for_demo: Path,
) -> None:
    http_port, mqtt_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "demo",
         "--http-port", str(http_port), "--mqtt-port", str(mqtt_port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmpdir_for_demo)},
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout or ():
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until_sync(
            lambda: bool(lines) or process.poll() is not None,
            timeout=START_TIMEOUT_S,
            message="the demo's line",
        )
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        match = LINE.match(lines[0])
        assert match, lines
        url, token = match["url"], match["token"]
        assert url == f"http://127.0.0.1:{http_port}/"
        (state_dir,) = tmpdir_for_demo.iterdir()  # the demo's own temporary state
        auth = {"Authorization": f"Bearer {token}"}
        page = httpx.get(url, timeout=10)
        assert page.status_code == 200
        assert "Gateway console" in page.text

        def alarms() -> bool:
            reply = httpx.get(f"{url}alarms?open=true", headers=auth, timeout=10)
            return reply.status_code == 200 and len(reply.json()["items"]) > 0

        wait_until_sync(alarms, timeout=60, interval=0.5, message="an alarm from the fleet")
        # A command to a simulated device is answered by its responder.
        reply = httpx.post(
            f"{url}devices/sim-00000/commands?wait=30",
            json={"name": "reboot"},
            headers=auth,
            timeout=40,
        )
        assert reply.status_code == 201
        assert reply.json()["command"]["status"] == "ACKED"
        session = process.pid
        assert any(str(state_dir) in cmd for _, (_, cmd) in _processes().items()), (
            "the embedded PostgreSQL runs from the demo's state directory"
        )

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, process.stderr.read() if process.stderr else ""
        left = {
            pid: cmd
            for pid, (sid, cmd) in _processes().items()
            if sid == session or str(state_dir) in cmd
        }
        assert not left, left
        assert not state_dir.exists(), "the temporary state is removed"
        assert len([line for line in lines if line.strip()]) == 1, lines
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


@pytest.mark.embedded
def test_the_demo_photographs_the_console_at_both_sizes(tmpdir_for_demo: Path) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    outdir = tmpdir_for_demo / "shots"
    state = tmpdir_for_demo / "state"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "demo", "--screenshots", str(outdir),
         "--http-port", "0", "--mqtt-port", str(free_port()), "--state-dir", str(state)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    expected = {
        f"console-{view}-{size}.png": dims
        for view in ("alarms", "alarm-detail", "campaign")
        for size, dims in (("desktop", (1280, 800)), ("phone", (390, 844)))
    }
    assert sorted(done.stdout.split()) == sorted(str(outdir / name) for name in expected)
    for name, dims in expected.items():
        assert _png_size(outdir / name) == dims, name


@pytest.mark.embedded
def test_the_demo_times_alarms_from_telemetry_to_an_open_page(tmpdir_for_demo: Path) -> None:
    """`--measure-live N` reports a figure for N alarms, each having reached a page that was
    never reloaded (the figure itself is the docs' business, not this test's)."""
    if not CHROMIUM.exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "demo", "--measure-live", "3",
         "--http-port", "0", "--mqtt-port", str(free_port()),
         "--state-dir", str(tmpdir_for_demo / "state")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.fullmatch(
        r"3 alarms, telemetry to the open page: p50 \d+ ms, max \d+ ms\n", done.stdout
    ), done.stdout
