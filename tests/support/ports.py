"""Free TCP ports on the loopback interface, for the servers a test starts.

As the simulator's (``sim.ports``, which says why): from outside the kernel's ephemeral range,
which every outgoing connection takes its local port from, so that no client's connect can take
a test server's port between ``free_port()`` and its bind (seen: PostgreSQL under Patroni
failing with "could not bind ... Address already in use"). Here each pytest-xdist worker takes
its own slice of that range.
"""

from __future__ import annotations

import os

from sim.ports import PortTurns, candidate_range, ephemeral_range


def worker_slice(ports: range, worker: str | None, workers: str | None) -> range:
    """This pytest-xdist worker's share of ``ports`` (``gw0``, ``gw1``, ...), all when alone."""
    count = max(int(workers) if workers else 1, 1)
    index = int(worker.removeprefix("gw")) if worker and worker.startswith("gw") else 0
    size = len(ports) // count
    start = ports.start + size * (index % count)
    return range(start, start + size)


_TURNS: PortTurns | None = None


def turns() -> PortTurns:
    """This process's turn through its worker's slice."""
    global _TURNS  # noqa: PLW0603 - one turn per process, made on first use
    if _TURNS is None:
        _TURNS = PortTurns(
            worker_slice(
                candidate_range(ephemeral_range()),
                os.environ.get("PYTEST_XDIST_WORKER"),
                os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
            )
        )
    return _TURNS


def free_port() -> int:
    """A port free on 127.0.0.1 a moment ago, outside the kernel's ephemeral range, not handed
    out before by this process until its slice wraps around. The caller binds it next; only
    another server binding that same port could take it first."""
    return turns().take()
