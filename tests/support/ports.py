"""Free TCP ports on the loopback interface."""

from __future__ import annotations

import socket


def free_port() -> int:
    """Return a port that was free on 127.0.0.1 a moment ago.

    The kernel picks it; the socket is closed before returning, so the caller binds it next
    (a race with another process grabbing it is possible but rare in practice).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
