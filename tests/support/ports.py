"""Free TCP ports on the loopback interface, for the servers a test starts.

As the simulator's (``sim.ports``, which says why): from outside the kernel's ephemeral range,
which every outgoing connection takes its local port from, so that no client's connect can take
a test server's port between ``free_port()`` and its bind (seen: PostgreSQL under Patroni
failing with "could not bind ... Address already in use"). Each pytest-xdist worker hands out
its own slice of that range, to the tests and to the simulator code they run alike: importing
this module makes it the process's turn (``sim.ports.use``).
"""

from __future__ import annotations

import os

from sim import ports
from sim.ports import PortTurns, candidate_range, ephemeral_range, free_port

__all__ = ["TURNS", "free_port", "worker_slice"]  # free_port: from this worker's slice


def worker_slice(ports_: range, worker: str | None, workers: str | None) -> range:
    """This pytest-xdist worker's share of ``ports_`` (``gw0``, ``gw1``, ...), all when alone."""
    count = max(int(workers) if workers else 1, 1)
    index = int(worker.removeprefix("gw")) if worker and worker.startswith("gw") else 0
    size = len(ports_) // count
    start = ports_.start + size * (index % count)
    return range(start, start + size)


TURNS = PortTurns(
    worker_slice(
        candidate_range(ephemeral_range()),
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
)
ports.use(TURNS)
