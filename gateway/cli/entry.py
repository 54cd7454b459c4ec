"""The ``gateway`` command's entry point, kept free of imports.

A Ctrl-C may come while Python is still importing the gateway (a few hundred milliseconds of a
start): caught here, it ends the process quietly instead of printing the import's traceback.
A SIGHUP then (`systemctl reload` racing a start of `gateway run`) is held, not fatal, and
applied once the daemon's handler is in place.
After the command returns, a Ctrl-C during the interpreter's teardown is ignored for the same
reason: everything has been stopped by then.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Final

# A SIGHUP that reached `gateway run` before the daemon's own handler existed (Python's default
# action would end the process: a `systemctl reload` racing a start). Held here, it is applied
# once the handler is installed (gateway.cli.commands).
_HUP_HELD: Final = threading.Event()


def _hold_hup(signum: int, frame: object) -> None:
    _HUP_HELD.set()


def take_held_hup() -> bool:
    """Whether a SIGHUP came before the daemon's handler; it is taken (said once)."""
    held = _HUP_HELD.is_set()
    _HUP_HELD.clear()
    return held


def _runs_daemon(argv: list[str]) -> bool:
    """`gateway run ...`: the first word that is not an option. (The other commands keep
    Python's default: a terminal hang-up ends them; `gateway demo` takes it as Ctrl-C once its
    own handlers are in place, before it starts anything.)"""
    words = [arg for arg in argv if not arg.startswith("-")]
    return bool(words) and words[0] == "run"


def main() -> int:
    if _runs_daemon(sys.argv[1:]):
        signal.signal(signal.SIGHUP, _hold_hup)
    try:
        from gateway.cli.commands import main as run

        return run()
    except KeyboardInterrupt:
        return 0  # nothing had started: cli.main takes Ctrl-C over before it starts anything
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
