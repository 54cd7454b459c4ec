"""The wheel carries the console: pyproject's package data names every file of the page."""

from __future__ import annotations

import tomllib
from pathlib import Path

from gateway.api.console_route import CONSOLE_DIR

ROOT = Path(__file__).resolve().parents[3]


def test_package_data_covers_every_console_file() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["gateway"]
    package = ROOT / "gateway"
    covered = {path for pattern in patterns for path in package.glob(pattern)}
    files = {path for path in CONSOLE_DIR.iterdir() if path.is_file()}
    assert files
    assert files <= covered, sorted(str(p) for p in files - covered)
