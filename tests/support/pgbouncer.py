"""A PgBouncer (Debian's ``pgbouncer``, 1.18) in front of the tests' PostgreSQL, on a free port.

One database entry: the test's database on the server of ``GATEWAY_TEST_DSN`` (TCP or a unix
socket directory), logged in as the DSN's user with no password (``auth_type = any``), in the
``pool_mode`` asked for. PgBouncer refuses to run as root: when run as root, it runs as the
``postgres`` user. Its directory is a temporary one; the process is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit

from tests.support.ports import free_port

PGBOUNCER = "/usr/sbin/pgbouncer"


def available() -> str | None:
    """Why PgBouncer cannot run here (None when it can)."""
    if not Path(PGBOUNCER).exists():
        return f"{PGBOUNCER} missing (apt-get install pgbouncer)"
    return None


class PgBouncer:
    def __init__(self, server_dsn: str, pool_mode: str) -> None:
        parts = urlsplit(server_dsn)
        self.database = parts.path.lstrip("/")
        self.user = parts.username or "postgres"
        socket_dir = parse_qs(parts.query).get("host", [""])[0]
        self.target = socket_dir if socket_dir.startswith("/") else parts.hostname or "127.0.0.1"
        self.target_port = parts.port or 5432
        self.pool_mode = pool_mode
        self.port = free_port()
        self.base = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        self.process: subprocess.Popen[bytes] | None = None

    def dsn(self) -> str:
        """The test's database, through PgBouncer."""
        return urlunsplit(
            ("postgresql", f"{self.user}@127.0.0.1:{self.port}", f"/{self.database}", "", "")
        )

    def start(self, timeout_s: float = 15) -> None:
        ini = self.base / "pgbouncer.ini"
        ini.write_text(
            f"""
[databases]
{self.database} = host={self.target} port={self.target_port} dbname={self.database} user={self.user}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = any
pool_mode = {self.pool_mode}
max_client_conn = 500
default_pool_size = 50
logfile = {self.base / "pgbouncer.log"}
"""
        )
        ids = None
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            ids = (entry.pw_uid, entry.pw_gid)
            for path in (self.base, ini):
                os.chown(path, *ids)
        self.process = subprocess.Popen(
            [PGBOUNCER, str(ini)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            user=None if ids is None else ids[0], group=None if ids is None else ids[1],
            extra_groups=None if ids is None else [], start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited ({self.process.returncode}):\n{self.log()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"pgbouncer not listening after {timeout_s}s:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        try:
            return (self.base / "pgbouncer.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def pgbouncer(server_dsn: str, pool_mode: str) -> Iterator[PgBouncer]:
    bouncer = PgBouncer(server_dsn, pool_mode)
    try:
        bouncer.start()
        yield bouncer
    finally:
        bouncer.stop()
