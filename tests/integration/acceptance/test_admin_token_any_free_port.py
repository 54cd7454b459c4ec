"""The zero-setup daemon on any free HTTP port (`[http] port = 0`, what its own line says to
do when 8080 is taken): the curl line it logs to try the admin token names the port it
listens on. It named the configured one, `http://127.0.0.1:0/alarms`, which no curl reaches."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

from tests.integration.acceptance.test_cli_beside_daemon import pytestmark, state_dir
from tests.support.daemon import DaemonProcess, http_healthy
from tests.support.ports import free_port
from tests.support.waiting import wait_until

__all__ = ["pytestmark", "state_dir"]  # the embedded mark; the fixture, out of pytest's tmp_path


def _lines(process: DaemonProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in process.log_text().splitlines() if line.startswith("{")]


async def test_the_curl_line_to_try_the_token_names_the_port_listened_on(
    state_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[node]\nstate_dir = "{state_dir}"\n'
        f'[mqtt]\nport = {free_port()}\n[http]\nport = 0\n[log]\nformat = "json"\n'
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        process.start()
        ports: list[int] = []

        async def healthy() -> bool:
            assert process.alive(), f"daemon exited:\n{process.log_tail()}"
            ports[:] = [e["port"] for e in _lines(process) if e["event"] == "http_listening"]
            return bool(ports) and await http_healthy(ports[0])

        await wait_until(healthy, timeout=90, message="daemon healthy")
        tries = [e["try_it"] for e in _lines(process) if "Bearer" in e.get("try_it", "")]
        assert tries, process.log_tail()
        for line in tries:  # run as a user pastes it
            ran = await asyncio.to_thread(
                subprocess.run,
                ["sh", "-c", f"{line} --silent --max-time 10"],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            assert (ran.returncode, ran.stdout[:1]) == (0, "{"), (line, ran.stderr)
            assert json.loads(ran.stdout)["items"] == []
        assert f":{ports[0]}/alarms" in tries[-1]
        assert process.terminate() == 0
    finally:
        process.cleanup()
