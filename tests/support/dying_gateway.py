"""``gateway`` whose process dies outright while judging a message with one event type.

A stand-in for what no ``except`` can catch — a crash in a C extension, memory exhausted, a
hang the service manager's watchdog ends — wired to a message the test chooses. Everything
else is the real daemon. Run as ``python -m tests.support.dying_gateway run --config FILE``;
importing this module (for its constants) changes nothing.
"""

from __future__ import annotations

import os
from typing import Any

DEADLY_EVENT = "DIE_NOW"
DEATH_CODE = 86


def _install() -> None:
    from gateway.alarms import engine

    evaluate = engine.evaluate

    def deadly(*args: Any, **kwargs: Any) -> Any:
        message = args[4]
        if DEADLY_EVENT in message.event_types():
            os._exit(DEATH_CODE)
        return evaluate(*args, **kwargs)

    engine.evaluate = deadly  # type: ignore[assignment]  # the one change: a deadly message


if __name__ == "__main__":
    from gateway.cli.entry import main

    _install()
    raise SystemExit(main())
