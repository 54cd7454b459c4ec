"""``gateway-sim devices`` as a real process against real brokers and a gateway on PostgreSQL:
stored telemetry and alarms, a clean stop on Ctrl-C, commands answered, exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import aiomqtt
import pytest

from gateway.config import parse_config
from protocol import TopicKind, Topics
from sim.cli import main
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.daemon import config_toml, count_rows, make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
EXIT_TIMEOUT_S = 30.0
DOOR_RULE = (
    '[[rules]]\nkey = "door-open"\nkind = "event"\nevent = "DOOR_OPEN"\nseverity = "MAJOR"\n'
)
SUMMARY = "gateway-sim devices: summary"


@dataclass
class Sim:
    process: asyncio.subprocess.Process
    stdout: Path
    stderr: Path

    def output(self) -> tuple[str, str]:
        return self.stdout.read_text(), self.stderr.read_text()

    def alive(self) -> bool:
        return self.process.returncode is None

    async def exit_code(self) -> int:
        try:
            async with asyncio.timeout(EXIT_TIMEOUT_S):
                return await self.process.wait()
        except TimeoutError:
            raise AssertionError(f"gateway-sim devices still running:\n{self.output()}") from None

    def sent(self) -> int:
        found = re.search(r"sent +(\d+) messages", self.output()[0])
        assert found is not None, self.output()
        return int(found.group(1))


@asynccontextmanager
async def gateway_sim(tmp_path: Path, *args: str) -> AsyncIterator[Sim]:
    """``python -m sim devices ARGS`` with its output in files; killed if the test fails."""
    stdout, stderr = tmp_path / "sim.out", tmp_path / "sim.err"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sim", "devices", *args, stdout=out, stderr=err
        )
    sim = Sim(process, stdout, stderr)
    try:
        yield sim
    finally:
        if sim.alive():
            process.kill()
            await process.wait()


def _running(sim: Sim) -> None:
    assert sim.alive(), f"gateway-sim devices exited early:\n{sim.output()}"


@pytest.mark.embedded
async def test_devices_on_the_embedded_broker_are_stored_and_raise_alarms(
    db_dsn: str, tmp_path: Path
) -> None:
    mqtt_port = free_port()
    # An empty host: the daemon starts its embedded broker (amqtt, MQTT 3.1.1) on mqtt_port.
    toml = config_toml(dsn=db_dsn, mqtt_port=mqtt_port, protocol="3.1.1", extra=DOOR_RULE)
    toml = toml.replace('host = "127.0.0.1"', 'host = ""', 1)
    # Two door devices opening a door every other message or so (seeded): alarms for sure.
    async with (
        running_daemon(parse_config(toml)),
        gateway_sim(
            tmp_path, "--port", str(mqtt_port), "--protocol", "3.1.1", "--duration", "3",
            "--devices", "4", "--rate", "50", "--mix", "walk=1,door=1",
            "--event-probability", "0.5", "--seed", "1",
        ) as sim,
    ):  # fmt: skip

        async def stored() -> bool:
            _running(sim)
            return await count_rows(db_dsn) > 0 and await count_rows(db_dsn, "alarm") > 0

        await wait_until(stored, timeout=30, message="telemetry and a door alarm stored")
        assert await sim.exit_code() == 0, sim.output()
        sent = sim.sent()

        async def all_stored() -> bool:
            return await count_rows(db_dsn) == sent

        await wait_until(all_stored, timeout=30, message=f"all {sent} messages stored")

    out, _ = sim.output()
    assert SUMMARY in out
    assert "devices    4 (walk 2, door 2)" in out
    assert 0 < sent <= 151, out  # never above the rate: 50 msg/s for 3 s, turn 0 at the start
    assert re.search(r"errors +0 ", out), out
    assert await count_rows(db_dsn, "device") == 4


@pytest.mark.embedded
async def test_mqtt_5_against_the_embedded_broker_says_to_use_3_1_1(tmp_path: Path) -> None:
    from gateway.embedded.broker import EmbeddedBroker

    async with (
        EmbeddedBroker("127.0.0.1", free_port()) as broker,
        gateway_sim(tmp_path, "--port", str(broker.port), "--duration", "1") as sim,
    ):
        assert await sim.exit_code() == 1
    out, err = sim.output()
    assert out == ""
    assert "cannot connect to the broker" in err
    assert "try --protocol 3.1.1" in err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
async def test_ctrl_c_stops_cleanly_with_a_summary(
    mosquitto: Mosquitto, tmp_path: Path, signum: signal.Signals
) -> None:
    received = 0

    async def count(client: aiomqtt.Client) -> None:
        nonlocal received
        async for _ in client.messages:
            received += 1

    async with aiomqtt.Client(mosquitto.host, mosquitto.port, identifier="counter") as sub:
        await sub.subscribe(TOPICS.subscription(TopicKind.TELEMETRY), qos=1)
        counting = asyncio.create_task(count(sub), name="count-telemetry")
        try:
            async with gateway_sim(
                tmp_path, "--port", str(mosquitto.port), "--devices", "10", "--rate", "200"
            ) as sim:

                def flowing() -> bool:
                    _running(sim)
                    return received >= 20

                await wait_until(flowing, timeout=30, message="telemetry flowing")
                sim.process.send_signal(signum)
                assert await sim.exit_code() == 0, sim.output()
            sent = sim.sent()
            # Every message the broker acknowledged reached the subscriber.
            await wait_until(lambda: received >= sent, timeout=30, message=f"{sent} received")
        finally:
            counting.cancel()
            await asyncio.gather(counting, return_exceptions=True)
    out, err = sim.output()
    assert SUMMARY in out
    assert sent >= 20
    assert "Traceback" not in err
    assert "\r" not in err  # no terminal, no progress line


async def _telemetry_arrives(broker: Mosquitto, sim: Sim, count: int) -> None:
    """Subscribe afresh and return once ``count`` telemetry messages arrived."""
    async with aiomqtt.Client(broker.host, broker.port) as sub:
        await sub.subscribe(TOPICS.subscription(TopicKind.TELEMETRY), qos=1)
        async with asyncio.timeout(30):
            for _ in range(count):
                await anext(sub.messages)
    _running(sim)


async def test_a_lost_broker_is_reconnected_and_counted_as_an_error(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    async with gateway_sim(
        tmp_path, "--port", str(mosquitto.port), "--devices", "5", "--rate", "100"
    ) as sim:
        await _telemetry_arrives(mosquitto, sim, 10)
        await asyncio.to_thread(mosquitto.kill)
        await asyncio.to_thread(mosquitto.start)
        await _telemetry_arrives(mosquitto, sim, 10)  # published on a new connection
        sim.process.send_signal(signal.SIGINT)
        assert await sim.exit_code() == 0, sim.output()
    out, err = sim.output()
    lost = re.search(r"connection (\d+)", out)
    assert lost is not None, out
    assert int(lost.group(1)) >= 1, out
    assert "devices_connection_lost" in err


async def test_a_progress_line_is_rewritten_on_a_terminal(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    controller, terminal = pty.openpty()
    stdout = tmp_path / "sim.out"
    with stdout.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sim", "devices", "--port", str(mosquitto.port),
            "--duration", "2.5", "--devices", "5", "--rate", "40", "--no-commands",
            stdout=out, stderr=terminal,
        )  # fmt: skip
    os.close(terminal)
    try:
        async with asyncio.timeout(EXIT_TIMEOUT_S):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    shown = b""
    with contextlib.suppress(OSError):  # EIO once everything written was read
        while chunk := os.read(controller, 4096):
            shown += chunk
    os.close(controller)
    lines = re.findall(rb"\r +[\d.]+ msg/s \| sent (\d+) \| commands 0 \| receipts 0 \| errors 0",
                       shown)  # fmt: skip
    assert len(lines) >= 2, shown  # about once a second, rewritten in place
    assert int(lines[-1]) > 0
    assert SUMMARY in stdout.read_text()


async def test_commands_to_simulated_devices_are_acked(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        extra=f'[[api.tokens]]\ntoken = "{OPERATOR}"\nrole = "operator"\nname = "sim"\n',
    )  # fmt: skip
    async with (
        running_daemon(config) as daemon,
        gateway_sim(
            tmp_path, "--port", str(mosquitto.port), "--devices", "5", "--rate", "20",
            "--client-id", "sim-commands-test",
        ) as sim,
        aiohttp.ClientSession() as http,
    ):  # fmt: skip

        async def stored() -> bool:
            _running(sim)
            return await count_rows(db_dsn) > 0

        # Telemetry flows only once the responder holds its subscription.
        await wait_until(stored, timeout=30, message="telemetry from the simulated devices")
        api = ApiClient(f"http://127.0.0.1:{daemon.http_port}", http)
        reply = await api.call(
            "POST", "/devices/sim-00003/commands?wait=20", json={"name": "reboot"}, token=OPERATOR
        )
        assert reply.status == 201, reply.body
        command = reply.body["command"]
        assert (command["status"], command["result"], command["result_code"]) == (
            "ACKED", "ACKED", 0,
        )  # fmt: skip
        sim.process.send_signal(signal.SIGINT)
        assert await sim.exit_code() == 0, sim.output()
    out, _ = sim.output()
    assert "commands   1 received, 1 answered" in out, out


def test_bad_arguments_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, reason in [
        (["--devices", "0"], "argument --devices: must be >= 1 and <= 50000, got 0"),
        (["--devices", "50001"], "argument --devices: must be >= 1 and <= 50000"),
        (["--rate", "0"], "argument --rate: must be > 0, got 0"),
        (["--mix", "walk=1,fog=2"], "argument --mix: unknown pattern 'fog' in the mix"),
        (["--protocol", "4"], "argument --protocol: invalid choice: '4'"),
        (["--failure-rate", "2"], "argument --failure-rate: must be >= 0 and <= 1, got 2"),
        (["--duration", "soon"], "argument --duration: expected a number, got 'soon'"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(["devices", *argv])
        assert exited.value.code == 2
        assert reason in capsys.readouterr().err


async def test_no_broker_at_start_exits_1(tmp_path: Path) -> None:
    port = free_port()
    async with gateway_sim(tmp_path, "--port", str(port), "--duration", "1") as sim:
        assert await sim.exit_code() == 1
    out, err = sim.output()
    assert out == ""
    assert f"cannot connect to the broker at 127.0.0.1:{port}" in err
    assert "3.1.1" not in err  # nothing answered: no hint about the protocol
