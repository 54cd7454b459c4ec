"""The entry point holds a SIGHUP that reaches `gateway run` before the daemon's handler."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from gateway.cli import entry


@pytest.fixture
def restore_sighup() -> Iterator[None]:
    before = signal.getsignal(signal.SIGHUP)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, before)
        entry.take_held_hup()


@pytest.mark.parametrize(
    ("argv", "daemon"),
    [
        (["run", "--config", "gateway.toml"], True),
        (["--version"], False),
        (["check-config", "run.toml"], False),
        (["demo"], False),
        ([], False),
    ],
)
def test_only_gateway_run_holds_sighup(argv: list[str], *, daemon: bool) -> None:
    assert entry._runs_daemon(argv) is daemon


@pytest.mark.usefixtures("restore_sighup")
def test_a_sighup_before_the_handler_is_held_once() -> None:
    signal.signal(signal.SIGHUP, entry._hold_hup)
    assert entry.take_held_hup() is False
    os.kill(os.getpid(), signal.SIGHUP)  # the process is still alive to say so
    assert entry.take_held_hup() is True
    assert entry.take_held_hup() is False  # taken: applied once
