"""A dead letter replayed in a process of its own: ``gateway dead-letters replay --id N``, run
by the daemon with its own program and configuration file, for a ``QUARANTINED`` letter.

Such a letter is a message that was in flight at two deaths of the process in a row (the
crash-loop breaker, :mod:`gateway.ingest.breaker`): what killed it is beyond any ``except``
(a crash in a C extension, memory, ``os._exit``), and only a replay tells whether the cause is
fixed. Replayed inside the daemon (``POST /dead-letters/{id}/replay``, the console's Replay),
a cause not fixed killed the node serving ingest for the fleet. In a child process it kills
that process alone: the command's own transaction is rolled back by PostgreSQL with its
connection, the letter is unchanged, and the daemon answers how the child ended. The child
takes exactly the command's path (:func:`gateway.ingest.replay.replay`, ``again``: a letter
named by id), so the outcome is the one the command prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import structlog

from gateway.config import ENV_DATABASE_DSN
from gateway.ingest.replay import ReplayOutcome

log = structlog.get_logger(__name__)

# The program the daemon runs when it was not told its own (a daemon built in a process that is
# not `gateway run`): the installed gateway.
DEFAULT_PROGRAM: Final = (sys.executable, "-m", "gateway")

# A child that has not answered by then is killed (a hang is one way a message kills a
# process: the service manager's watchdog ends the daemon for it). A replay is one letter: a
# start of the command (a second or two), a connection, one transaction.
TIMEOUT_S: Final = 60.0

# What a service manager hands the daemon alone: the child is no service of its own (its
# READY=1, its pings, would speak for the daemon).
_DAEMON_ONLY: Final = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)

_SUMMARY: Final = re.compile(r"^replayed (\d+): (\d+) ingested")
_ERROR_CHARS: Final = 300
_LOG_CHARS: Final = 4000


class ReplayCrashedError(Exception):
    """The child ended without an outcome (``ended`` says how): nothing was changed."""

    def __init__(self, dead_letter_id: int, ended: str) -> None:
        super().__init__(f"the replay of dead letter {dead_letter_id} ended without an outcome")
        self.dead_letter_id = dead_letter_id
        self.ended = ended


@dataclass(slots=True)
class ProcessReplay:
    """Replays in a child process, one at a time on a node (each is a Python process of its
    own: a script replaying hundreds at once must not exhaust the host's memory)."""

    # How to start this gateway again: ``python -m <the module the daemon was started as>``.
    program: Sequence[str]
    # The daemon's configuration file (None: it runs on every default, as the child then does).
    config_path: Path | None
    # The database the daemon uses (the embedded server's once started), handed to the child.
    dsn: str | None
    timeout_s: float = TIMEOUT_S
    _one_at_a_time: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))

    def command(self, dead_letter_id: int) -> list[str]:
        config = ["--config", str(self.config_path)] if self.config_path is not None else []
        # Replayed in that process (the command would otherwise hand it to one more).
        return [
            *self.program, "dead-letters", "replay", "--id", str(dead_letter_id),
            "--in-this-process", *config,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if name not in _DAEMON_ONLY}
        if self.dsn:
            # The daemon's own database, whatever the file says now (it wins over the file).
            env[ENV_DATABASE_DSN] = self.dsn
        return env

    async def replay_one(self, dead_letter_id: int) -> ReplayOutcome | None:
        """The outcome the child printed; None when it did not replay the letter (none has
        that id, or another replay holds it: as :func:`gateway.ingest.replay.replay_one`).
        Raises :class:`ReplayCrashedError` when the child ended without saying (a signal, an
        exit with no outcome, the timeout)."""
        async with self._one_at_a_time:
            returncode, stdout, stderr = await self._run(dead_letter_id)
        told, outcome = _answer(dead_letter_id, stdout)
        if told:
            return outcome
        ended = _ended(returncode, stderr, self.timeout_s)
        log.warning(
            "dead_letter_replay_crashed",
            dead_letter_id=dead_letter_id,
            ended=ended,
            output=stderr.decode("utf-8", "replace")[-_LOG_CHARS:],
        )
        raise ReplayCrashedError(dead_letter_id, ended)

    async def _run(self, dead_letter_id: int) -> tuple[int | None, bytes, bytes]:
        """The child's exit status (None: killed at the timeout), its output and its errors."""
        child = await asyncio.create_subprocess_exec(
            *self.command(dead_letter_id),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.environment(),
        )
        assert child.stdout is not None
        assert child.stderr is not None
        # Read as it comes (a full pipe would block the child), and kept whatever happens: an
        # outcome the child printed before it hung is still its outcome.
        output = asyncio.ensure_future(child.stdout.read())
        errors = asyncio.ensure_future(child.stderr.read())
        returncode: int | None
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    returncode = await child.wait()
            except TimeoutError:
                # Its transaction is rolled back with its connection: nothing is changed.
                returncode = None
                _kill(child)
                await child.wait()
        except BaseException:
            # The request went away (the client, the node stopping): the child with it.
            _kill(child)
            output.cancel()
            errors.cancel()
            raise
        return returncode, await output, await errors


def _kill(child: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        child.kill()


def _answer(dead_letter_id: int, stdout: bytes) -> tuple[bool, ReplayOutcome | None]:
    """From the command's output (``N\\t<outcome>`` once the letter's replay committed, then
    ``replayed 1: 1 ingested, 0 still invalid``; or ``N\\tnot found``, ``N\\tbusy: ...``): the
    whether it said anything of the letter, and its outcome (None: not replayed)."""
    lines = stdout.decode("utf-8", "replace").splitlines()
    said = f"{dead_letter_id}\t"
    told = [line.removeprefix(said) for line in lines if line.startswith(said)]
    if not told:
        return False, None
    outcome = told[0]
    if outcome == "not found" or outcome.startswith("busy:"):
        return True, None
    summary = next((m for m in map(_SUMMARY.match, lines) if m is not None), None)
    if summary is not None and summary.group(1) == "1":
        succeeded = summary.group(2) == "1"
    else:
        # Committed and said, then the child died before its summary: the outcome says it.
        succeeded = outcome != "truncated" and not outcome.startswith("still_invalid")
    return True, ReplayOutcome(dead_letter_id, outcome, succeeded)


def _ended(returncode: int | None, stderr: bytes, timeout_s: float) -> str:
    """How the child ended, for the operator: ``killed by signal 11 (SIGSEGV)``, ``exited with
    code 1: <its last error>``, ``did not finish within 60 s (killed)``."""
    if returncode is None:
        return f"did not finish within {timeout_s:g} s (killed)"
    if returncode < 0:
        try:
            name = f" ({signal.Signals(-returncode).name})"
        except ValueError:
            name = ""
        return f"killed by signal {-returncode}{name}"
    ended = f"exited with code {returncode}"
    error = _last_error(stderr)
    return f"{ended}: {error}" if error else ended


def _last_error(stderr: bytes) -> str:
    """The child's last line on stderr: a log line's ``error`` (or event), or the text."""
    lines = [line for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1].strip()
    try:
        entry = json.loads(last)
    except ValueError:
        entry = None
    if isinstance(entry, dict):
        last = str(entry.get("error") or entry.get("event") or last)
    return last[:_ERROR_CHARS]
