"""A cap on log lines that anyone on the network can cause.

A refused request costs its sender one packet and us one log line: without a cap, a script
asking ``GET /alarms`` without a token writes the log (and journald's disk) as fast as it
asks. Past the cap the lines are counted, not written; the next line written says how many
were left out (``suppressed``).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LogLimit:
    """At most ``lines`` lines per ``interval_s``; the rest counted."""

    def __init__(
        self, lines: int, interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lines = lines
        self.interval_s = interval_s
        self._clock = clock
        self._window_start = clock()
        self._written = 0
        self._suppressed = 0

    def take(self) -> int | None:
        """None: leave this line out. Otherwise write it, with the returned number of lines
        left out since the last one written (0 when none were)."""
        now = self._clock()
        if now - self._window_start >= self.interval_s:
            self._window_start = now
            self._written = 0
        if self._written >= self.lines:
            self._suppressed += 1
            return None
        self._written += 1
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed
