"""sd_notify(3) without a dependency: readiness, reload, stop, watchdog and status datagrams.

The protocol is one ``AF_UNIX`` ``SOCK_DGRAM`` datagram of newline-separated ``KEY=value``
lines sent to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace). Outside
systemd the variable is unset and every call is a cheap no-op returning ``False``.

A notification that cannot be delivered must never take the daemon down, so nothing here raises
or logs: the worst outcome of a lost ``WATCHDOG=1`` is a restart, which is what the watchdog is
for. The socket is non-blocking so a wedged service manager cannot stall the event loop.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Final, Self

__all__ = ["Notifier"]

ENV_NOTIFY_SOCKET: Final = "NOTIFY_SOCKET"
ENV_WATCHDOG_USEC: Final = "WATCHDOG_USEC"
ENV_WATCHDOG_PID: Final = "WATCHDOG_PID"


class Notifier:
    """Talks to the service manager named by ``NOTIFY_SOCKET``; inert when it is unset.

    The constructor only reads the environment; the socket is created on the first send.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get(ENV_NOTIFY_SOCKET, ""))
        self._watchdog_usec = env.get(ENV_WATCHDOG_USEC, "")
        self._watchdog_pid = env.get(ENV_WATCHDOG_PID, "")
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one datagram; ``True`` if the kernel accepted it."""
        if self._address is None or not lines:
            return False
        payload = "\n".join(lines).encode("utf-8", errors="replace")
        try:
            with self._lock:
                if self._socket is None:
                    self._socket = socket.socket(
                        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    )
                    self._socket.setblocking(False)
                sock = self._socket
            sent = sock.sendto(payload, self._address)
        except OSError:
            return False
        return sent == len(payload)

    def ready(self, status: str | None = None) -> bool:
        if status is None:
            return self.notify("READY=1")
        return self.notify("READY=1", _status_line(status))

    def reloading(self) -> bool:
        # Type=notify-reload (systemd 253+) matches the reload to this timestamp; older
        # managers ignore the field.
        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={now_usec}")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the current state's timeout (``TimeoutStartSec``
        while starting): the manager times out only past both the original bound and this
        new one, so a long step can send it again and again."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(_status_line(text))

    def watchdog_interval_s(self) -> float | None:
        """How often to send ``WATCHDOG=1``: half of ``WATCHDOG_USEC``, as sd_watchdog_enabled(3)
        advises; ``None`` when no watchdog is armed for this process."""
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            return None
        if usec <= 0:
            return None
        if self._watchdog_pid:
            # The variables were meant for another process (a parent that exec'd us, say).
            try:
                pid = int(self._watchdog_pid)
            except ValueError:
                return None
            if pid != os.getpid():
                return None
        return usec / 2 / 1_000_000

    def close(self) -> None:
        with self._lock:
            sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _socket_address(value: str) -> str | None:
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    # Unset, empty, or a transport this module does not speak (systemd 254's "vsock:...").
    return None


def _status_line(text: str) -> str:
    return "STATUS=" + " ".join(text.splitlines())
