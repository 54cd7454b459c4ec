"""The installed release of the gateway (its wheel's version)."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version


@functools.cache
def gateway_version() -> str:
    """Read once a process: the release this process loaded (an upgrade installed while it
    runs is the next process's). Reading the package metadata cost 149 µs a call (`timeit`),
    paid by every `/health` answer and every webhook's User-Agent."""
    try:
        return version("mqtt-alarm-gateway")
    except PackageNotFoundError:
        return "0+unknown"
