"""``gateway`` on a host whose wall clock is off: its NTP broken, its RTC drifting.

``GATEWAY_TEST_CLOCK_SKEW_S`` (seconds, negative: behind) is added to ``time.time`` and
``time.time_ns``, what the daemon reads the time of day from; the monotonic clock, the
database's and every other process's stay right. Everything else is the real daemon. Run as
``python -m tests.support.skewed_gateway run --config FILE``; importing this module (for its
constants) changes nothing.
"""

from __future__ import annotations

import os
import time

SKEW_ENV = "GATEWAY_TEST_CLOCK_SKEW_S"


def _install() -> None:
    skew = float(os.environ.get(SKEW_ENV, "0"))
    wall, wall_ns = time.time, time.time_ns
    time.time = lambda: wall() + skew
    time.time_ns = lambda: wall_ns() + int(skew * 1e9)


if __name__ == "__main__":
    _install()
    from gateway.cli.entry import main

    raise SystemExit(main())
