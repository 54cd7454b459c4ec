"""What the daemon reads from the child that replayed a QUARANTINED letter: the command's own
output (`gateway dead-letters replay --id N`), and how the child ended when it said nothing."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from gateway.config import ENV_DATABASE_DSN
from gateway.ingest.replay import ReplayOutcome
from gateway.ingest.replay_process import ProcessReplay, ReplayCrashedError, _answer, _ended


def test_the_outcome_line_and_the_summary_answer() -> None:
    stored = b"7\tstored\nreplayed 1: 1 ingested, 0 still invalid\n"
    assert _answer(7, stored) == (True, ReplayOutcome(7, "stored", True))
    refused = b"7\tstill_invalid: INVALID\nreplayed 1: 0 ingested, 1 still invalid\n"
    assert _answer(7, refused) == (True, ReplayOutcome(7, "still_invalid: INVALID", False))
    # Committed and said, then dead before the summary: the outcome says it.
    assert _answer(7, b"7\tduplicate\n") == (True, ReplayOutcome(7, "duplicate", True))
    assert _answer(7, b"7\ttruncated\n") == (True, ReplayOutcome(7, "truncated", False))


def test_not_replayed_and_silence_are_told_apart() -> None:
    assert _answer(7, b"replayed 0: 0 ingested, 0 still invalid\n7\tnot found\n") == (True, None)
    busy = b"replayed 0: 0 ingested, 0 still invalid\n7\tbusy: another replay held it; run again\n"
    assert _answer(7, busy) == (True, None)
    # Another id's line (17, 70) is not this letter's.
    assert _answer(7, b"17\tstored\n70\tstored\n") == (False, None)
    assert _answer(7, b"") == (False, None)


def test_how_the_child_ended_is_named() -> None:
    assert _ended(-signal.SIGSEGV, b"", 60) == "killed by signal 11 (SIGSEGV)"
    assert _ended(-signal.SIGKILL, b"", 60) == "killed by signal 9 (SIGKILL)"
    assert _ended(86, b"", 60) == "exited with code 86"
    log = b'{"event": "startup_failed", "error": "cannot reach the database at x: refused"}\n'
    assert _ended(1, log, 60) == "exited with code 1: cannot reach the database at x: refused"
    assert _ended(2, b"invalid configuration: rules[0].op: bad\n\n", 60) == (
        "exited with code 2: invalid configuration: rules[0].op: bad"
    )
    assert _ended(None, b"", 60) == "did not finish within 60 s (killed)"


def test_the_child_gets_the_daemons_database_and_not_its_service_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv(ENV_DATABASE_DSN, "postgresql://file@elsewhere/db")
    replay = ProcessReplay(("python", "-m", "gateway"), Path("/etc/g.toml"), "postgresql://x/db")
    env = replay.environment()
    assert "NOTIFY_SOCKET" not in env
    assert "WATCHDOG_USEC" not in env
    assert env[ENV_DATABASE_DSN] == "postgresql://x/db"
    assert replay.command(5) == [
        *("python", "-m", "gateway", "dead-letters", "replay", "--id", "5"),
        *("--in-this-process", "--config", "/etc/g.toml"),
    ]
    assert ProcessReplay(("gw",), None, None).command(5) == [
        *("gw", "dead-letters", "replay", "--id", "5", "--in-this-process"),
    ]


async def test_a_hung_child_is_killed_at_the_timeout() -> None:
    # A program that prints nothing and never ends: killed, and said so.
    hang = (sys.executable, "-c", "import time; time.sleep(600)", "--")
    replay = ProcessReplay(hang, None, None, timeout_s=0.5)
    with pytest.raises(ReplayCrashedError) as raised:
        await asyncio.wait_for(replay.replay_one(3), timeout=30)
    assert raised.value.ended == "did not finish within 0.5 s (killed)"
