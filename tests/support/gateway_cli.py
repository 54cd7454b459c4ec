"""``gateway run`` as an operator starts it: a child process, its whole output read as lines."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

RUN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Finished:
    returncode: int
    output: str

    def records(self) -> list[dict[str, Any]]:
        """Every line of the output as JSON; fails naming the first line that is not."""
        records = []
        for line in self.output.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise AssertionError(f"not JSON: {line!r}\n--- output ---\n{self.output}") from None
        return records

    def the(self, event: str) -> dict[str, Any]:
        """The one line of ``event``."""
        found = [r for r in self.records() if r.get("event") == event]
        assert len(found) == 1, f"{event}: {len(found)} lines\n--- output ---\n{self.output}"
        return found[0]

    def assert_no_traceback(self) -> None:
        for marker in ("Traceback", "KeyboardInterrupt", 'File "'):
            assert marker not in self.output, self.output


async def gateway_run(
    config: Path, *, env: dict[str, str] | None = None, command: tuple[str, ...] = ("run",)
) -> Finished:
    """Run ``gateway <command> --config`` to its end (an expected failure ends it quickly)."""

    def run() -> Finished:
        done = subprocess.run(
            [sys.executable, "-m", "gateway", *command, "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        return Finished(done.returncode, done.stdout.decode(errors="replace"))

    return await asyncio.to_thread(run)


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line mentions ``text`` (a state directory, say)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if process.info["status"] != psutil.STATUS_ZOMBIE and any(text in a for a in cmdline):
            found.append(process)
    return found
