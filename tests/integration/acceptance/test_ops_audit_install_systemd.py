"""`gateway install-systemd` into a place it cannot write (run without root, a mistyped
--target): one line naming the place and why, exit 1, never a Python traceback. An OSError other
than the three it expected (FileExistsError, FileNotFoundError, ValueError) went up uncaught:
a traceback, PermissionError for the everyday case of forgetting sudo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_an_unwritable_target_is_one_line_and_exit_1(tmp_path: Path) -> None:
    executable = tmp_path / "bin" / "gateway"
    executable.parent.mkdir()
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    not_a_directory = tmp_path / "units"
    not_a_directory.write_text("a file where the directory should be\n")
    target = not_a_directory / "system"
    command = ("install-systemd", "--allow-tmp", "--target", str(target))
    done = subprocess.run(
        [sys.executable, "-m", "gateway", *command, "--executable", str(executable)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(target) in lines[0], lines[0]
