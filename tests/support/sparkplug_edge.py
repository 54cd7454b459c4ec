"""Sparkplug edge nodes nobody here wrote, for the host tests: Eclipse Tahu's JavaScript client
(npm ``sparkplug-client`` 3.2.4) in a node process (tests/support/sparkplug/edge.js), driven
by JSON lines; and PyPI's ``pysparkplug`` (tests/support/sparkplug/pysparkplug_edge.py) in a
venv of its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import pytest

EDGE_DIR: Final = Path(__file__).resolve().parent / "sparkplug"


def edge_script() -> Path:
    """edge.js, its node_modules installed (npm ci) once; skips without node and npm."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are missing (Tahu's sparkplug-client)")
    if not (EDGE_DIR / "node_modules" / "sparkplug-client").is_dir():
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=EDGE_DIR,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, f"npm ci in {EDGE_DIR} failed:\n{done.stderr}"
    return EDGE_DIR / "edge.js"


PYVENV: Final = EDGE_DIR / ".pyvenv"


def pysparkplug_python() -> Path:
    """The interpreter of the venv holding pysparkplug (made once, as .ci/run makes it):
    pysparkplug pins paho-mqtt<2, which the gateway's own environment cannot hold."""
    python = PYVENV / "bin" / "python"
    probe = [str(python), "-c", "import pysparkplug"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return python
    for step in (
        [sys.executable, "-m", "venv", str(PYVENV)],
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "-r",
            str(EDGE_DIR / "pysparkplug-requirements.txt"),
        ],
    ):
        done = subprocess.run(step, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, f"{step} failed:\n{done.stderr}"
    return python


class EdgeNode:
    """One ``sparkplug-client`` edge node in its own process."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.events: list[dict[str, Any]] = []
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                self.events.append(json.loads(line))
                self._changed.set()

    async def send(self, op: str, **fields: object) -> None:
        """One command; returns once the client took it (``published``)."""
        before = sum(1 for e in self.events if e.get("event") == "published")
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        await self.process.stdin.drain()
        await self.wait_for(
            lambda: sum(1 for e in self.events if e.get("event") == "published") > before,
            f"the edge node to take {op}",
        )

    async def wait_for(self, predicate: Any, what: str, timeout: float = 30.0) -> None:  # noqa: ASYNC109
        async with asyncio.timeout(timeout):
            while not predicate():
                self._changed.clear()
                if self.process.returncode is not None and not predicate():
                    raise AssertionError(f"edge node exited before {what}: {self.events}")
                await self._changed.wait()

    def count(self, event: str) -> int:
        return sum(1 for e in self.events if e.get("event") == event)

    def kill(self) -> None:
        """SIGKILL: the connection drops without DISCONNECT, and the broker sends its Will."""
        self.process.send_signal(signal.SIGKILL)


@contextlib.asynccontextmanager
async def edge_node(
    port: int, group: str, node: str, *, qos1: bool = False
) -> AsyncIterator[EdgeNode]:
    """``qos1``: its publishes at QoS 1 instead of Sparkplug's QoS 0 (see edge.js)."""
    script = edge_script()
    process = await asyncio.create_subprocess_exec(
        "node",
        str(script),
        f"mqtt://127.0.0.1:{port}",
        group,
        node,
        f"edge-{group}-{node}",
        *(["qos1"] if qos1 else []),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=EDGE_DIR,
    )
    edge = EdgeNode(process)
    try:
        await edge.wait_for(lambda: edge.count("connected") >= 1, "connecting")
        yield edge
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        edge._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await edge._reader
