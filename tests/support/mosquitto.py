"""A real mosquitto broker, started and stopped by tests.

Facts about mosquitto 2.0 this class relies on (checked against 2.0.11):

* Run as root, mosquitto drops privileges to the ``mosquitto`` user (or ``nobody``) unless the
  config says ``user root``. It then cannot open a log file or write its persistence database
  in a root-owned temporary directory, and it does not fail for it: it runs without a log and
  loses the database on exit (only "Error: Permission denied." on stderr). Outside root the
  ``user`` setting has no effect, so writing it unconditionally is harmless.
* On SIGTERM it writes the in-memory database (sessions, subscriptions, queued QoS 1/2
  messages) before exiting, so stop() + start() keeps every offline session's queue.
  ``autosave_interval 0`` disables periodic saves: SIGTERM (and SIGUSR1) save, SIGKILL loses
  everything since the last clean stop. That makes kill() deterministic, where a periodic
  autosave would make "what survives a crash" depend on timing, and spares a full rewrite of
  a database holding 100k queued messages every interval.
* ``max_queued_messages`` defaults to 1000 per offline client and excess QoS 1 messages are
  dropped silently; tests queue up to 100k, hence the high default here and
  ``max_queued_bytes 0`` (no byte limit).
* ``set_tcp_nodelay`` defaults to false. Turning it on cannot add latency (Nagle can only hold
  small packets back); on loopback it measured about 5% more QoS 1 throughput with 50
  publishes in flight and no change in a single publish-to-delivery round trip (~0.3 ms).
* A repeated option is accepted and the last occurrence wins, so ``extra_config`` (appended
  last) can override anything written here.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import aiomqtt

from tests.support.ports import free_port
from tests.support.waiting import wait_until_sync

START_TIMEOUT_S = 10.0
# Saving a database holding 100k queued messages on SIGTERM takes a while.
STOP_TIMEOUT_S = 60.0
_FALLBACK_BINARY = "/usr/sbin/mosquitto"


class Mosquitto:
    """One mosquitto process listening on ``host:port``, with its files under ``workdir``.

    The port is chosen at construction (when not given) so that it is known before start()
    and stays the same across restart().
    """

    host: str = "127.0.0.1"

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        max_inflight_messages: int = 20,
        max_queued_messages: int = 200_000,
        persistence: bool = True,
        extra_config: str = "",
    ) -> None:
        self.workdir = workdir
        self.port: int = port if port is not None else free_port()
        self.max_inflight_messages = max_inflight_messages
        self.max_queued_messages = max_queued_messages
        self.persistence = persistence
        self.extra_config = extra_config
        self._process: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    @property
    def config_path(self) -> Path:
        return self.workdir / "mosquitto.conf"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    @property
    def stderr_path(self) -> Path:
        """Where errors go before the log file is open (bad config, port in use)."""
        return self.workdir / "mosquitto.stderr"

    def is_running(self) -> bool:
        # A method, not a property: mypy would narrow a property across stop()/start().
        return self._process is not None and self._process.poll() is None

    def config_text(self) -> str:
        lines = [
            "# Written by tests.support.mosquitto on every start.",
            "per_listener_settings false",
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            "user root",
            f"max_inflight_messages {self.max_inflight_messages}",
            f"max_queued_messages {self.max_queued_messages}",
            "max_queued_bytes 0",
            "set_tcp_nodelay true",
            f"log_dest file {self.log_path}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
            "log_timestamp true",
            "log_timestamp_format %Y-%m-%dT%H:%M:%S",
        ]
        if self.persistence:
            lines += [
                "persistence true",
                # mosquitto concatenates location and file name: the trailing slash matters.
                f"persistence_location {self.workdir}/",
                "persistence_file mosquitto.db",
                "autosave_interval 0",
            ]
        else:
            lines.append("persistence false")
        return "\n".join(lines) + "\n" + self.extra_config + "\n"

    def start(self) -> None:
        """Launch mosquitto and return once each of its listeners accepts TCP connections."""
        if self.is_running():
            raise RuntimeError(f"mosquitto already running on port {self.port}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text())
        binary = shutil.which("mosquitto") or _FALLBACK_BINARY
        self._stderr = self.stderr_path.open("ab")
        self._process = subprocess.Popen(
            [binary, "-c", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._stderr,
            stderr=self._stderr,
        )
        try:
            wait_until_sync(
                self._accepting_connections,
                timeout=START_TIMEOUT_S,
                message=f"mosquitto listening on {self.host}:{self.port}",
            )
        except (AssertionError, RuntimeError) as exc:
            self.kill()
            raise RuntimeError(
                f"mosquitto failed to start on port {self.port}:\n{self.log_tail()}"
            ) from exc
        except BaseException:
            self.kill()
            raise

    def listeners(self) -> list[tuple[str, int]]:
        """Every ``listener`` of the configuration, ``extra_config``'s included (a TLS one is
        opened after the first: a test connecting to it must not be let in before)."""
        found = []
        for line in self.config_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "listener":
                found.append((words[2] if len(words) > 2 else self.host, int(words[1])))
        return found

    def _accepting_connections(self) -> bool:
        assert self._process is not None
        if self._process.poll() is not None:
            raise RuntimeError(f"mosquitto exited with code {self._process.returncode}")
        for host, port in self.listeners():
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    pass
            except OSError:
                return False
        return True

    def stop(self) -> None:
        """SIGTERM and wait for exit; mosquitto saves its persistence database on the way out."""
        self._signal_and_wait(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL and wait: a crash, losing whatever was not saved by a previous stop()."""
        self._signal_and_wait(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: every connection stays open and nothing is answered (a broker too slow to
        send a PUBACK) until :meth:`resume`. Resume before stop()."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: the broker handles what waited meanwhile."""
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Clean stop then start, on the same port with the same persistence database."""
        self.stop()
        self.start()

    def _signal_and_wait(self, signum: signal.Signals) -> None:
        process = self._process
        if process is None:
            return
        try:
            if process.poll() is None:
                process.send_signal(signum)
                try:
                    process.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                    raise AssertionError(
                        f"mosquitto did not exit within {STOP_TIMEOUT_S}s of {signum.name}:\n"
                        f"{self.log_tail()}"
                    ) from None
        finally:
            self._process = None
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None

    def log_tail(self, n: int = 50) -> str:
        """The last ``n`` lines of the broker log, plus anything it wrote to stderr."""
        parts = []
        for path in (self.log_path, self.stderr_path):
            if path.exists():
                with path.open(errors="replace") as lines:
                    tail = "".join(deque(lines, maxlen=n))
                if tail:
                    parts.append(f"--- {path.name} ---\n{tail}")
        return "\n".join(parts)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.asynccontextmanager
async def events_subscriber(
    port: int, prefix: str = "iot", *, persistent: bool = False
) -> AsyncIterator[aiomqtt.Client]:
    """A person's app on the broker, subscribed to every event. An alarm is PUSHED only when
    its event reached someone (docs/behaviour.md §5): with this subscriber the MQTT 5 PUBACK
    of the event says so (reason code 0, not 0x10 "no matching subscribers").

    ``persistent``: a session the broker keeps (and, stopped cleanly, saves) while the app is
    offline; its subscription still matches, the broker queueing the events for it."""
    client = (
        aiomqtt.Client("127.0.0.1", port, identifier="person-app", clean_session=False)
        if persistent
        else aiomqtt.Client("127.0.0.1", port)
    )
    async with client:
        await client.subscribe(f"{prefix}/events/#", qos=1)
        yield client
