"""Ctrl-C at any moment of a first start (embedded PostgreSQL and broker): the process exits 0,
prints no traceback, and leaves no process behind; nor does it wait out a connect timeout.

Ctrl-C at a terminal signals the whole foreground process group: the gateway runs in a group
of its own here, and the test sends SIGINT to that group, as the terminal would. Each moment is
reached by watching the process tree or the HTTP answer, never by sleeping; what is left
afterwards is read from the process table (any process naming the state directory).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import aiohttp
import pytest

from tests.support.daemon import config_toml
from tests.support.gateway_cli import Finished, processes_mentioning
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

MOMENTS: Final = ["at-once", "during-initdb", "postmaster-starting", "serving"]


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path (see conftest): the embedded server's user must reach it.
    path = Path(tempfile.mkdtemp(prefix="gw-sigint-"))
    try:
        yield path
    finally:
        for process in processes_mentioning(str(path)):
            process.kill()
        shutil.rmtree(path, ignore_errors=True)


class Gateway:
    """``gateway run`` in a process group of its own, its output in a file."""

    def __init__(
        self,
        state_dir: Path,
        workdir: Path,
        *,
        config: Path | None = None,
        http_port: int | None = None,
    ) -> None:
        """The zero-setup configuration under ``state_dir``, unless given one."""
        self.state_dir = state_dir
        self.http_port = http_port or free_port()
        self.config = config or workdir / "gateway.toml"
        if config is None:
            self.config.write_text(
                f'[node]\nstate_dir = "{state_dir / "state"}"\n'
                f"[mqtt]\nport = {free_port()}\n[http]\nport = {self.http_port}\n"
                '[log]\nformat = "json"\nlevel = "info"\n'
            )
        self.log_path = workdir / "gateway.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gateway", "run", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ctrl_c(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGINT)

    def wait(self, timeout: float = 90) -> Finished:
        assert self.process is not None
        returncode = self.process.wait(timeout=timeout)
        return Finished(returncode, self.log_path.read_text(errors="replace"))

    def running(self, program: str) -> bool:
        """A process of ``program`` works on this state directory."""
        return any(
            Path(process.info["cmdline"][0]).name == program
            for process in processes_mentioning(str(self.state_dir))
        )

    async def health_reason(self) -> str | None:
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{self.http_port}/health") as response,
            ):
                reason: str | None = (await response.json()).get("reason")
                return reason
        except aiohttp.ClientError:
            return None

    async def health(self) -> int | None:
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{self.http_port}/health") as response,
            ):
                return response.status
        except aiohttp.ClientError:
            return None


def _assert_nothing_left(state_dir: Path) -> None:
    left = processes_mentioning(str(state_dir))
    assert not left, [p.info["cmdline"] for p in left]
    lock = state_dir / "state" / "pg.lock"
    if lock.exists():
        with lock.open("ab") as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if still owned


async def _reach(moment: str, gateway: Gateway) -> None:
    if moment == "at-once":
        return
    if moment == "during-initdb":
        await wait_until(lambda: gateway.running("initdb"), timeout=60, message="initdb runs")
    elif moment == "postmaster-starting":
        await wait_until(lambda: gateway.running("postgres") and not gateway.running("initdb"),
                         timeout=60, interval=0.005, message="the postmaster runs")  # fmt: skip
    else:
        await wait_until(lambda: _is(gateway, 200), timeout=60, message="healthy")


async def _is(gateway: Gateway, status: int) -> bool:
    return await gateway.health() == status


@pytest.mark.embedded
@pytest.mark.parametrize("moment", MOMENTS)
async def test_ctrl_c_during_a_first_start_exits_cleanly_leaving_nothing(
    moment: str, state_dir: Path, tmp_path: Path
) -> None:
    gateway = Gateway(state_dir, tmp_path)
    gateway.start()
    try:
        await _reach(moment, gateway)
        gateway.ctrl_c()
        done = await asyncio.to_thread(gateway.wait)
    finally:
        if gateway.process is not None and gateway.process.poll() is None:
            gateway.process.kill()
    # Before Python has set up its own SIGINT handler (the first milliseconds of the process),
    # SIGINT ends it like any program: silently, nothing started yet. Just after, while the
    # interpreter still imports its site module, CPython itself reports the KeyboardInterrupt
    # as a fatal start-up error (exit 1): no code of the gateway has run either.
    interpreter_starting = (
        moment == "at-once"
        and done.returncode == 1
        and "Fatal Python error: init_import_site" in done.output
        and done.output.rstrip().endswith("KeyboardInterrupt")
    )
    if not interpreter_starting:
        clean = (0, -signal.SIGINT) if moment == "at-once" else (0,)
        assert done.returncode in clean, done.output
        done.assert_no_traceback()
        done.records()  # every line is JSON
    _assert_nothing_left(state_dir)
    if moment == "during-initdb":
        assert "embedded_postgres_initialised" not in done.output, "initdb was not interrupted"
        # What the interrupted initdb left does not stand in the way of the next start.
        gateway.start()
        try:
            await wait_until(lambda: _is(gateway, 200), timeout=90, message="healthy")
            assert gateway.process is not None
            gateway.process.send_signal(signal.SIGTERM)
            assert (await asyncio.to_thread(gateway.wait)).returncode == 0
        finally:
            if gateway.process is not None and gateway.process.poll() is None:
                gateway.process.kill()
        _assert_nothing_left(state_dir)


async def test_ctrl_c_while_a_database_does_not_answer_does_not_wait_out_the_timeout(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    # A server that accepts connections and never says a word: connecting would take the
    # whole (here 600 s) connect timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        config = tmp_path / "gateway.toml"
        http_port = free_port()
        config.write_text(
            config_toml(
                dsn=f"postgresql://postgres@127.0.0.1:{port}/gateway",
                mqtt_port=mosquitto.port,
                http_port=http_port,
            ).replace("[database]\n", "[database]\nconnect_timeout_s = 600\n")
        )
        gateway = Gateway(tmp_path, tmp_path, config=config, http_port=http_port)
        gateway.start()
        try:

            async def connecting() -> bool:
                reason = await gateway.health_reason()
                return reason is not None and reason.startswith("connecting to the database")

            await wait_until(connecting, timeout=30, message="connecting to the silent one")
            gateway.ctrl_c()
            # Far below the connect timeout: the stop does not wait for it.
            done = await asyncio.to_thread(gateway.wait, 60)
        finally:
            if gateway.process is not None and gateway.process.poll() is None:
                gateway.process.kill()
    assert done.returncode == 0, done.output
    done.assert_no_traceback()
    done.records()
