"""Free TCP ports on the loopback interface, for the servers a test starts.

A port the kernel picks for a bind to port 0 comes from its ephemeral range, the range every
outgoing connection on the machine also takes its local port from: between the moment such a
port is handed out and the moment the server binds it, any client connecting anywhere may take
it (seen: PostgreSQL under Patroni failing with "could not bind ... Address already in use").
So ports are handed out from outside that range, where only a server binding that very port
can collide: each pytest-xdist worker its own slice, in turn from a random start, each one
checked free by binding it first.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

# Ports below this are left alone: the well-known and registered servers (PostgreSQL, Redis,
# RabbitMQ and its Erlang distribution port 25672, ...).
LOWEST = 30_000
# Fewer ports than this above the ephemeral range: take them below it instead.
ENOUGH = 2_000


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range:
    """The kernel's ephemeral ports (Linux's default where it cannot be read)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        low, high = 32_768, 60_999
    return range(low, high + 1)


def candidate_range(ephemeral: range) -> range:
    """The ports handed out: above the ephemeral range, else between LOWEST and it."""
    above = range(ephemeral.stop, 65_536)
    if len(above) >= ENOUGH:
        return above
    below = range(LOWEST, ephemeral.start)
    if len(below) >= ENOUGH:
        return below
    raise RuntimeError(f"no room for test ports outside the ephemeral range {ephemeral}")


def worker_slice(ports: range, worker: str | None, workers: str | None) -> range:
    """This pytest-xdist worker's share of ``ports`` (``gw0``, ``gw1``, ...), all when alone."""
    count = int(workers) if workers else 1
    index = int(worker.removeprefix("gw")) if worker and worker.startswith("gw") else 0
    size = len(ports) // max(count, 1)
    start = ports.start + size * (index % max(count, 1))
    return range(start, start + size)


class _Ports:
    def __init__(self) -> None:
        self._slice: range | None = None
        self._next = 0

    def take(self) -> int:
        if self._slice is None:
            self._slice = worker_slice(
                candidate_range(ephemeral_range()),
                os.environ.get("PYTEST_XDIST_WORKER"),
                os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
            )
            # A random start: a test run right after another does not reach for the ports
            # the last one's servers may still be closing.
            self._next = random.randrange(len(self._slice))
        ports = self._slice
        for _ in range(len(ports)):
            port = ports[self._next % len(ports)]
            self._next += 1
            if _bindable(port):
                return port
        raise RuntimeError(f"no free port in {ports}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


_PORTS = _Ports()


def free_port() -> int:
    """A port free on 127.0.0.1 a moment ago, outside the kernel's ephemeral range (see the
    module's docstring), not handed out before by this process until its slice wraps around.

    The caller binds it next; only another server binding that same port could take it first.
    """
    return _PORTS.take()
