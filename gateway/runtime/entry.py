"""The ``gateway`` command's entry point, kept free of imports.

A Ctrl-C may come while Python is still importing the gateway (a few hundred milliseconds of a
start): caught here, it ends the process quietly instead of printing the import's traceback.
After the command returns, a Ctrl-C during the interpreter's teardown is ignored for the same
reason: everything has been stopped by then.
"""

from __future__ import annotations

import signal


def main() -> int:
    try:
        from gateway.runtime.cli import main as run

        return run()
    except KeyboardInterrupt:
        return 0  # nothing had started: cli.main takes Ctrl-C over before it starts anything
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
