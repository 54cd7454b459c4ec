"""A mosquitto the benchmark starts itself, with a known configuration on a free port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from sim.ports import free_port


def wait_listening(port: int, timeout_s: float = 10.0) -> None:
    """Until something accepts connections on 127.0.0.1:`port` (a broker just started)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            time.sleep(0.02)
        else:
            return
    raise RuntimeError(f"mosquitto did not start listening on {port}")


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(found).exists():
        raise RuntimeError("the mosquitto binary is required (apt-get install mosquitto)")
    return found


class BenchBroker:
    """mosquitto with an inflight window of ``inflight`` for every client, in-memory queues."""

    def __init__(self, *, inflight: int = 1000) -> None:
        self.port = free_port()
        self.inflight = inflight
        self.workdir = Path(tempfile.mkdtemp(prefix="gw-bench-mosquitto-"))
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "user root\n"
            "persistence false\n"
            f"max_inflight_messages {self.inflight}\n"
            "max_queued_messages 0\n"
            "max_queued_bytes 0\n"
            "set_tcp_nodelay true\n"
            f"log_dest file {self.workdir / 'mosquitto.log'}\n"
        )
        self._process = subprocess.Popen(
            [mosquitto_binary(), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_listening(self.port)
        return self

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=30)
        shutil.rmtree(self.workdir, ignore_errors=True)
