"""The embedded PostgreSQL: cold and warm starts, restarts, and recovery from a killed owner."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from gateway.embedded.postgres import (
    EmbeddedPostgres,
    EmbeddedPostgresError,
    start_embedded_postgres,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.embedded

PROJECT_ROOT = Path(__file__).resolve().parents[3]

# A gateway that starts the server, reports the DSN, then waits to be killed.
OWNER_SCRIPT = """
import sys
import tempfile
from pathlib import Path
from gateway.embedded.postgres import EmbeddedPostgres
server = EmbeddedPostgres(Path(sys.argv[1]))
print("DSN " + server.start(), flush=True)
sys.stdin.read()
"""


def postmaster_pid(server: EmbeddedPostgres) -> int | None:
    try:
        return int((server.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state != "Z"  # an orphan reparented to a non-reaping pid 1 lingers as a zombie


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """Not under pytest's tmp_path: every pytest session starting meanwhile (other developers,
    other CI jobs) resets /tmp/pytest-of-<user> to 0700, cutting the server's user off from a
    running cluster (it PANICs at the next checkpoint)."""
    root = Path(tempfile.mkdtemp(prefix="gw-pgtest-"))
    try:
        yield root / "state"
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def servers(state_dir: Path) -> AsyncIterator[list[EmbeddedPostgres]]:
    """Every server a test creates; all stopped afterwards, even one left by a killed owner."""
    created: list[EmbeddedPostgres] = []
    yield created
    for server in created:
        await asyncio.to_thread(server.stop)
    for server in created:
        pid = postmaster_pid(server)
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGINT)  # fast shutdown

            def gone(pid: int = pid) -> bool:
                return not pid_alive(pid)

            await wait_until(gone, timeout=30, message=f"leftover postmaster {pid} stopped")


async def fetch(dsn: str, query: str) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


async def execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def test_cold_start_creates_a_socket_only_gateway_database_that_survives_restart(
    state_dir: Path, servers: list[EmbeddedPostgres]
) -> None:
    server = EmbeddedPostgres(state_dir)
    servers.append(server)
    assert not await asyncio.to_thread(state_dir.exists)  # the constructor touches nothing

    dsn = await asyncio.to_thread(server.start)

    assert dsn == server.dsn
    assert f"host={server.socket_dir}" in dsn
    assert server.is_running()
    assert (server.data_dir / "PG_VERSION").exists()
    assert (server.state_dir / "pg.log").stat().st_size > 0
    assert await fetch(dsn, "SELECT current_database()") == "gateway"
    assert await fetch(dsn, "SHOW listen_addresses") == ""
    assert await fetch(dsn, "SHOW fsync") == "on"
    assert await fetch(dsn, "SHOW shared_buffers") == "32MB"
    assert await fetch(dsn, "SHOW max_connections") == "50"
    await execute(dsn, "CREATE TABLE kept (id int PRIMARY KEY)", "INSERT INTO kept VALUES (1), (2)")

    await asyncio.to_thread(server.stop)
    assert not server.is_running()

    again = await asyncio.to_thread(server.start)
    assert again == dsn
    assert await fetch(dsn, "SELECT sum(id) FROM kept") == 3


async def test_start_while_running_returns_the_dsn_and_async_with_stops(
    state_dir: Path, servers: list[EmbeddedPostgres]
) -> None:
    server = EmbeddedPostgres(state_dir)
    servers.append(server)
    async with server:
        pid = postmaster_pid(server)
        assert await asyncio.to_thread(server.start) == server.dsn
        assert postmaster_pid(server) == pid
    assert not server.is_running()
    assert pid is not None
    assert not pid_alive(pid)


async def test_server_left_by_a_sigkilled_owner_is_stopped_and_restarted(
    state_dir: Path, servers: list[EmbeddedPostgres]
) -> None:
    successor = EmbeddedPostgres(state_dir)
    servers.append(successor)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER_SCRIPT, str(state_dir),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        async with asyncio.timeout(60):
            while not (line := (await owner.stdout.readline()).decode()).startswith("DSN "):
                assert line, "the owner exited before reporting its DSN"
        dsn = line.removeprefix("DSN ").strip()
        await execute(dsn, "CREATE TABLE kept (id int)", "INSERT INTO kept VALUES (7)")
    finally:
        owner.kill()
        await owner.wait()
    orphan = postmaster_pid(successor)
    assert orphan is not None
    assert pid_alive(orphan), "SIGKILL of the owner must leave its server running"

    assert await asyncio.to_thread(successor.start) == dsn

    assert postmaster_pid(successor) != orphan
    await wait_until(lambda: not pid_alive(orphan), timeout=10, message="orphan stopped")
    assert await fetch(dsn, "SELECT id FROM kept") == 7
    await asyncio.to_thread(successor.stop)
    assert not successor.is_running()


async def test_a_second_owner_in_the_same_process_is_refused(
    state_dir: Path, servers: list[EmbeddedPostgres]
) -> None:
    first = await start_embedded_postgres(state_dir)
    servers.append(first)
    second = EmbeddedPostgres(state_dir)
    servers.append(second)

    with pytest.raises(EmbeddedPostgresError, match="owns the embedded PostgreSQL"):
        await asyncio.to_thread(second.start)

    assert first.is_running()
    await asyncio.to_thread(second.stop)  # stops nothing: it never started a server
    assert first.is_running()
    await asyncio.to_thread(first.stop)
    assert await asyncio.to_thread(second.start) == first.dsn  # the lock was released


@pytest.mark.parametrize("holder", ["dead", "unrelated"])
async def test_stale_postmaster_pid_file_does_not_prevent_start(
    state_dir: Path, servers: list[EmbeddedPostgres], holder: str
) -> None:
    server = EmbeddedPostgres(state_dir)
    servers.append(server)
    dsn = await asyncio.to_thread(server.start)
    await execute(dsn, "CREATE TABLE kept (id int)", "INSERT INTO kept VALUES (5)")
    pid_file = server.data_dir / "postmaster.pid"
    contents = pid_file.read_text()
    await asyncio.to_thread(server.stop)
    if holder == "dead":
        exited = await asyncio.create_subprocess_exec("true")
        await exited.wait()
        stale_pid = exited.pid
    else:
        stale_pid = os.getpid()  # alive, but not a postgres: must be neither signalled nor feared
    pid_file.write_text(f"{stale_pid}\n" + contents.split("\n", 1)[1])

    assert await asyncio.to_thread(server.start) == dsn

    assert postmaster_pid(server) not in {None, stale_pid}
    assert await fetch(dsn, "SELECT id FROM kept") == 5


async def test_stop_is_idempotent(state_dir: Path, servers: list[EmbeddedPostgres]) -> None:
    server = EmbeddedPostgres(state_dir)
    servers.append(server)
    server.stop()  # never started
    await asyncio.to_thread(server.start)
    await asyncio.to_thread(server.stop)
    await asyncio.to_thread(server.stop)
    assert not server.is_running()


async def test_a_server_that_fails_to_start_raises_with_the_log_tail(
    state_dir: Path, servers: list[EmbeddedPostgres]
) -> None:
    server = EmbeddedPostgres(state_dir)
    servers.append(server)
    await asyncio.to_thread(server.start)
    await asyncio.to_thread(server.stop)
    auto_conf = server.data_dir / "postgresql.auto.conf"
    original = auto_conf.read_text()
    auto_conf.write_text(original + "no_such_setting_xyz = 1\n")

    with pytest.raises(EmbeddedPostgresError, match="no_such_setting_xyz") as raised:
        await asyncio.to_thread(server.start)

    assert "pg_ctl start exited with" in str(raised.value)
    assert not server.is_running()
    auto_conf.write_text(original)
    await asyncio.to_thread(server.start)  # nothing stayed locked or half-started
    assert server.is_running()


def test_a_long_state_dir_gets_a_short_stable_socket_dir(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120) / "state"
    server = EmbeddedPostgres(deep)

    assert not server.socket_dir.is_relative_to(deep)
    assert len(os.fsencode(server.socket_dir / ".s.PGSQL.5432")) < 100
    assert EmbeddedPostgres(deep).socket_dir == server.socket_dir
    assert EmbeddedPostgres(tmp_path / "other").socket_dir != server.socket_dir
    assert EmbeddedPostgres(tmp_path / "s").socket_dir == tmp_path / "s" / "pgsock"
