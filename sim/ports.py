"""Free TCP ports on the loopback interface for the servers the simulator starts (the bench's
and the field simulation's mosquitto, the gateways' HTTP ports, webhooks).

A port the kernel picks for a bind to port 0 comes from its ephemeral range, the range every
outgoing connection on the machine also takes its local port from: between the moment such a
port is handed out and the moment the server binds it, any client connecting anywhere may take
it. So ports are handed out from outside that range, where only a server binding that very
port can collide, in turn from a random start, each checked free by binding it first. The
tests hand theirs out the same way, a slice per pytest-xdist worker (tests/support/ports.py).
"""

from __future__ import annotations

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
    raise RuntimeError(f"no room for ports outside the ephemeral range {ephemeral}")


class PortTurns:
    """Ports of ``ports`` in turn from a random start (a run right after another does not
    reach for the ports the last one's servers may still be closing), each checked free."""

    def __init__(self, ports: range) -> None:
        if not ports:
            raise ValueError("no ports to hand out")
        self.ports = ports
        self.next = random.randrange(len(ports))

    def take(self) -> int:
        ports = self.ports
        for _ in range(len(ports)):
            port = ports[self.next % len(ports)]
            self.next += 1
            if bindable(port):
                return port
        raise RuntimeError(f"no free port in {ports}")


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


_TURNS: PortTurns | None = None


def use(turns: PortTurns) -> None:
    """Hand out this process's ports from ``turns`` from now on (the tests: their pytest-xdist
    worker's slice, so that two workers never reach for the same port)."""
    global _TURNS  # noqa: PLW0603 - the process's one turn
    _TURNS = turns


def free_port() -> int:
    """A port free on 127.0.0.1 a moment ago, outside the kernel's ephemeral range, not handed
    out before by this process until the range wraps around. The caller binds it next."""
    global _TURNS  # noqa: PLW0603 - one turn per process, made on first use
    if _TURNS is None:
        _TURNS = PortTurns(candidate_range(ephemeral_range()))
    return _TURNS.take()
