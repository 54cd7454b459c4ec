"""A PostgreSQL 15 high-availability pair on loopback ports, managed by Patroni over etcd.

Two PostgreSQL instances with streaming replication and ``synchronous_mode: true`` (Patroni
names the standby in ``synchronous_standby_names``; ``synchronous_commit = on``), each under its
own Patroni process, with one etcd member as Patroni's store. Everything lives under one
temporary directory and every process is stopped by its PID. ``initdb`` and ``postgres`` refuse
to run as root: when run as root, the processes run as the ``postgres`` user.

Used by tests/integration/acceptance/test_pg_failover.py and by ``scripts/ha-pair`` (which
starts a pair and prints its multi-host DSN until interrupted).

``kill_primary`` is a host dying: the primary's Patroni and its PostgreSQL processes are
SIGKILLed together (a postmaster SIGKILLed under a living Patroni is only restarted by it, as
the same primary). The leader key in etcd then expires after ``ttl`` and the standby's Patroni
promotes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PATRONI = "/usr/bin/patroni"
ETCD = "/usr/bin/etcd"
SCOPE = "gateway-ha"
# The leader key's lease: how long a dead primary stays the leader. Patroni requires
# loop_wait + 2 * retry_timeout <= ttl.
TTL_S = 10
LOOP_WAIT_S = 1
RETRY_TIMEOUT_S = 3
# PostgreSQL's, Patroni's and etcd's ways of saying something went wrong.
_ERROR_MARKS = re.compile(r"FATAL|PANIC|ERROR|CRITICAL| E \| |already in use")


def available() -> str | None:
    """Why a pair cannot run here (None when it can)."""
    for binary in (PATRONI, ETCD, str(PG_BIN / "postgres")):
        if not Path(binary).exists():
            return f"{binary} missing (apt-get install patroni etcd-server postgresql-15)"
    return None


def _run_as() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    entry = pwd.getpwnam("postgres")
    return entry.pw_uid, entry.pw_gid


@dataclass
class Member:
    name: str
    port: int
    api_port: int
    data_dir: Path
    config: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def status(self) -> dict[str, object] | None:
        """Patroni's view of this member (GET /patroni), None when it does not answer."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.api_port}/patroni", timeout=2
            ) as response:
                return dict(json.load(response))
        except urllib.error.HTTPError as exc:  # 503 for a replica or a stopped postgres
            return dict(json.load(exc))
        except (OSError, ValueError):
            return None

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None


@dataclass
class HaPair:
    """Start with :meth:`start`, stop with :meth:`stop` (or use :func:`ha_pair`)."""

    base: Path
    members: list[Member] = field(default_factory=list)
    etcd_port: int = 0
    etcd: subprocess.Popen[bytes] | None = None
    database: str = "gateway"

    @classmethod
    def create(cls) -> HaPair:
        base = Path(tempfile.mkdtemp(prefix="ha-postgres-"))
        ids = _run_as()
        if ids is not None:
            os.chown(base, *ids)
        pair = cls(base=base, etcd_port=free_port())
        for n in range(2):
            name = f"pg{n}"
            pair.members.append(
                Member(
                    name=name, port=free_port(), api_port=free_port(),
                    data_dir=base / name, config=base / f"{name}.yml", log=base / f"{name}.log",
                )
            )  # fmt: skip
        return pair

    def _start_over_on_new_ports(self) -> None:
        """Everything stopped and removed, and every port chosen again."""
        self.stop()
        for entry in self.base.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        self.etcd, self.etcd_port = None, free_port()
        for member in self.members:
            member.process, member.port, member.api_port = None, free_port(), free_port()

    def _port_taken(self) -> bool:
        """Whether a process of the pair could not bind its port (PostgreSQL, Patroni's REST
        API and etcd all say "address already in use")."""
        for path in [self.base / "etcd.log", *(m.log for m in self.members)]:
            with contextlib.suppress(OSError):
                if "already in use" in path.read_text().lower():
                    return True
        return False

    # -- the DSN the gateway uses -------------------------------------------------------

    def dsn(self, database: str | None = None) -> str:
        hosts = ",".join(m.address for m in self.members)
        db = database or self.database
        return f"postgresql://postgres@{hosts}/{db}?target_session_attrs=read-write"

    def member_dsn(self, member: Member, database: str | None = None) -> str:
        return f"postgresql://postgres@{member.address}/{database or self.database}"

    # -- start and stop -----------------------------------------------------------------

    def _popen(
        self, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        ids = _run_as()
        with log.open("ab") as out:
            if ids is not None:
                os.chown(log, *ids)
            return subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.base, env={**os.environ, **(env or {})},
                user=None if ids is None else ids[0], group=None if ids is None else ids[1],
                extra_groups=None if ids is None else [], start_new_session=True,
            )  # fmt: skip

    def _write_config(self, member: Member) -> None:
        ids = _run_as()
        config = {
            "scope": SCOPE,
            "name": member.name,
            "restapi": {
                "listen": f"127.0.0.1:{member.api_port}",
                "connect_address": f"127.0.0.1:{member.api_port}",
            },
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL_S,
                    "loop_wait": LOOP_WAIT_S,
                    "retry_timeout": RETRY_TIMEOUT_S,
                    "maximum_lag_on_failover": 1048576,
                    # The standby Patroni names in synchronous_standby_names is the only one
                    # it promotes: a commit the primary acknowledged is on it.
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": False,
                        "parameters": {
                            "synchronous_commit": "on",
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "max_wal_senders": 5,
                            "max_replication_slots": 5,
                            "max_connections": 200,
                            "wal_keep_size": "128MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
            },
            "postgresql": {
                "listen": member.address,
                "connect_address": member.address,
                "data_dir": str(member.data_dir),
                "bin_dir": str(PG_BIN),
                "pgpass": str(self.base / f"{member.name}.pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                },
                "parameters": {"unix_socket_directories": str(self.base)},
                "pg_hba": [
                    "local all all trust",
                    "host replication replicator 127.0.0.1/32 trust",
                    "host all all 127.0.0.1/32 trust",
                ],
            },
            "tags": {"nofailover": False, "noloadbalance": False},
        }
        # JSON is YAML: no YAML writer needed.
        member.config.write_text(json.dumps(config, indent=1))
        if ids is not None:
            os.chown(member.config, *ids)

    def start(self, timeout_s: float = 90, attempts: int = 3) -> None:
        """etcd, then pg0's Patroni (which bootstraps and leads), then pg1's, until pg1 is the
        synchronous standby; then the gateway's database.

        A port is chosen free and bound a moment later by another process, so it can be taken
        in between (any outgoing connection on the machine may get it as its local port): when
        a process of the pair says so in its log, the pair starts over on new ports, at most
        ``attempts`` times. Any other failure is raised at once.
        """
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout_s)
            except (TimeoutError, PairProcessExited):
                if attempt == attempts or not self._port_taken():
                    raise
                self._start_over_on_new_ports()
            else:
                return

    def _start_once(self, timeout_s: float) -> None:
        peer = free_port()
        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self.etcd = self._popen(
            [
                ETCD, "--name", "ha", "--data-dir", str(self.base / "etcd"),
                "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"ha=http://127.0.0.1:{peer}",
                "--enable-v2=true",
            ],
            self.base / "etcd.log",
        )  # fmt: skip
        _wait(
            lambda: _http_ok(f"{etcd_url}/health"), timeout_s, "etcd healthy", self, starting=True
        )
        for n, member in enumerate(self.members):
            self._write_config(member)
            member.process = self._popen([PATRONI, str(member.config)], member.log)
            if n == 0:  # the first one bootstraps (initdb) and becomes the leader
                _wait(
                    lambda: self.role(self.members[0]) == "master", timeout_s, "pg0 primary",
                    self, starting=True,
                )  # fmt: skip
        self.wait_synchronous(timeout_s, starting=True)
        self._create_database()

    def _create_database(self) -> None:
        primary = self.primary()
        assert primary is not None
        subprocess.run(
            [str(PG_BIN / "psql"), "-X", "-q", "-h", "127.0.0.1", "-p", str(primary.port),
             "-U", "postgres", "-d", "postgres", "-c", f"CREATE DATABASE {self.database}"],
            check=True, capture_output=True,
        )  # fmt: skip

    def stop(self) -> None:
        """Every process by its PID: Patroni (which stops its PostgreSQL), then etcd."""
        for member in self.members:
            process = member.process
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            self._kill_postgres(member)
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.terminate()
            try:
                self.etcd.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.etcd.kill()
                self.etcd.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    # -- what the pair looks like -------------------------------------------------------

    def role(self, member: Member) -> str | None:
        status = member.status()
        if status is None or status.get("state") != "running":
            return None
        return str(status.get("role"))

    def primary(self) -> Member | None:
        found = [m for m in self.members if self.role(m) == "master"]
        return found[0] if len(found) == 1 else None

    def synchronous_standby(self) -> Member | None:
        primary = self.primary()
        if primary is None:
            return None
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{primary.api_port}/cluster", timeout=2
            ) as response:
                cluster = json.load(response)
        except (OSError, ValueError):
            return None
        for entry in cluster.get("members", []):
            if entry.get("role") == "sync_standby" and entry.get("state") in {
                "running",
                "streaming",
            }:
                return next((m for m in self.members if m.name == entry.get("name")), None)
        return None

    def wait_synchronous(self, timeout_s: float = 90, *, starting: bool = False) -> None:
        _wait(
            lambda: self.synchronous_standby() is not None,
            timeout_s, "a sync standby", self, starting=starting,
        )  # fmt: skip

    # -- a host dying -------------------------------------------------------------------

    def kill_primary(self) -> Member:
        """SIGKILL the primary's Patroni and every one of its PostgreSQL processes."""
        primary = self.primary()
        assert primary is not None, "no primary to kill"
        assert primary.process is not None
        primary.process.send_signal(signal.SIGKILL)
        primary.process.wait()
        self._kill_postgres(primary)
        return primary

    def _kill_postgres(self, member: Member) -> None:
        pid = member.postmaster_pid()
        if pid is None:
            return
        pids = [pid, *_children(pid)]
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)

    def log_tail(self, lines: int = 30) -> str:
        """Each log's errors (wherever they are: a failed bootstrap ends in a long traceback
        that buries PostgreSQL's FATAL), then its last ``lines`` lines."""
        out = []
        for path in [self.base / "etcd.log", *(m.log for m in self.members)]:
            with contextlib.suppress(OSError):
                text = path.read_text().splitlines()
                errors = [line for line in text if _ERROR_MARKS.search(line)]
                out.append(
                    f"--- {path.name}: errors\n" + "\n".join(errors[-lines:])
                    + f"\n--- {path.name}: last {lines} lines\n" + "\n".join(text[-lines:])
                )  # fmt: skip
        return "\n".join(out)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310  # http://127.0.0.1 only
            return bool(response.status == 200)
    except (OSError, ValueError):
        return False


class PairProcessExited(RuntimeError):
    """A process of the pair ended while the pair was starting."""


def _wait(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    pair: HaPair,
    *,
    starting: bool = False,
) -> None:
    """Poll a condition with a deadline (a blocking helper: the pair starts before any loop);
    while ``starting``, a process of the pair that has exited ends the wait at once (later one
    may have been killed on purpose)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if starting:
            named = [("etcd", pair.etcd), *((m.name, m.process) for m in pair.members)]
            for name, process in named:
                if process is not None and process.poll() is not None:
                    raise PairProcessExited(
                        f"HA pair: {name} exited ({process.returncode}) while waiting for "
                        f"{what}\n{pair.log_tail()}"
                    )
        if time.monotonic() > deadline:
            raise TimeoutError(f"HA pair: no {what} after {timeout_s}s\n{pair.log_tail()}")
        time.sleep(0.1)


@contextlib.contextmanager
def ha_pair() -> Iterator[HaPair]:
    pair = HaPair.create()
    try:
        pair.start()
        yield pair
    finally:
        pair.cleanup()
