"""``gateway`` whose process dies outright while judging a message with one event type.

A stand-in for what no ``except`` can catch — a crash in a C extension, memory exhausted, a
hang the service manager's watchdog ends — wired to a message the test chooses. Everything
else is the real daemon. Run as ``python -m tests.support.dying_gateway run --config FILE``.
"""

from __future__ import annotations

import os
from typing import Any

from gateway.alarms import engine
from gateway.runtime.entry import main

DEADLY_EVENT = "DIE_NOW"
DEATH_CODE = 86

_evaluate = engine.evaluate


def _deadly(*args: Any) -> Any:
    message = args[-1]
    if DEADLY_EVENT in message.event_types():
        os._exit(DEATH_CODE)
    return _evaluate(*args)


engine.evaluate = _deadly  # type: ignore[assignment]  # the one change: a deadly message

if __name__ == "__main__":
    raise SystemExit(main())
