"""The simulator takes its broker from the gateway's config file, with the gateway's defaults;
``publish`` publishes only where a gateway says it is online (or with ``--force``), dated now,
from devices of its own prefix."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import aiomqtt
import msgspec

from gateway.config import Config
from sim.gateway_config import Broker, broker_of
from sim.telemetry import EPOCH_MS
from tests.support.mosquitto import Mosquitto


def test_the_simulators_defaults_are_the_gateways() -> None:
    defaults = Config()
    assert broker_of(None) == Broker(
        host="127.0.0.1", port=defaults.mqtt.port, prefix=defaults.mqtt.topic_prefix
    )
    assert defaults.mqtt.host == ""  # the embedded broker, on 127.0.0.1 (Startup.broker)


def test_a_config_file_names_the_broker(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[mqtt]\nport = 18830\ntopic_prefix = "site/a"\n[log]\nformat = "json"\n')
    assert broker_of(config) == Broker(host="127.0.0.1", port=18830, prefix="site/a")
    config.write_text('[mqtt]\nhost = "broker.lan"\n')
    assert broker_of(config) == Broker(host="broker.lan", port=1883, prefix="iot")


async def test_publish_reaches_the_broker_the_gateway_config_names(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'[mqtt]\nport = {mosquitto.port}\ntopic_prefix = "site"\n')
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as listener:
        await listener.subscribe("site/devices/+/telemetry", qos=1)
        published = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "sim",
                "publish",
                "--config",
                str(config),
                "--devices",
                "2",
                "--messages",
                "5",
                "--force",  # no gateway on this broker: the test listens instead
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert published.returncode == 0, published.stderr
        assert "published 5 messages" in published.stdout
        received = 0
        async with asyncio.timeout(30):
            async for _message in listener.messages:
                received += 1
                if received == 5:
                    break
    assert received == 5


def _publish(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sim", "publish", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_publish_refuses_where_no_gateway_is_online(mosquitto: Mosquitto) -> None:
    """No retained ``online`` on ``{prefix}/gateways/+/status``: one line saying so and how to
    go on, exit 1, and nothing published (the test's own marker is the first message the
    listener gets). An ``offline`` status (a gateway's Will) is no gateway either."""
    prefix = "refuse"
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as listener:
        await listener.publish(f"{prefix}/gateways/gone/status", b"offline", qos=1, retain=True)
        await listener.subscribe(f"{prefix}/devices/+/telemetry", qos=1)
        refused = await asyncio.to_thread(
            _publish, "--port", str(mosquitto.port), "--prefix", prefix, "--messages", "5"
        )
        assert refused.returncode == 1, refused.stderr
        assert refused.stdout == ""
        (line,) = refused.stderr.splitlines()
        assert line.startswith(
            f"gateway-sim publish: no gateway is online at 127.0.0.1:{mosquitto.port}, "
            f"prefix {prefix} (no retained 'online' on {prefix}/gateways/+/status"
        ), line
        assert "--force" in line
        assert "--config" in line
        await listener.publish(f"{prefix}/devices/marker/telemetry", b"marker", qos=1)
        async with asyncio.timeout(30):
            first = await anext(aiter(listener.messages))
        assert first.payload == b"marker"
        await listener.publish(f"{prefix}/gateways/gone/status", b"", qos=1, retain=True)


async def test_publish_says_which_gateway_listens_and_dates_messages_now(
    mosquitto: Mosquitto,
) -> None:
    prefix = "listened"
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as listener:
        # What a running gateway leaves on its broker (its birth; its Will says offline).
        await listener.publish(f"{prefix}/gateways/node-7/status", b"online", qos=1, retain=True)
        await listener.subscribe(f"{prefix}/devices/+/telemetry", qos=1)
        before_ms = time.time_ns() // 1_000_000
        done = await asyncio.to_thread(
            _publish, "--port", str(mosquitto.port), "--prefix", prefix,
            "--devices", "2", "--messages", "4",
        )  # fmt: skip
        after_ms = time.time_ns() // 1_000_000
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(
            f"published 4 messages from 2 devices (pub-00000 ...) to 127.0.0.1:{mosquitto.port}, "
            f"prefix {prefix} (gateway node-7 online)"
        ), done.stdout
        received = []
        async with asyncio.timeout(30):
            async for message in listener.messages:
                received.append(message)
                if len(received) == 4:
                    break
        await listener.publish(f"{prefix}/gateways/node-7/status", b"", qos=1, retain=True)
    devices = {str(m.topic).split("/")[2] for m in received}
    assert devices == {"pub-00000", "pub-00001"}  # never the demo's demo-… nor sim-…
    for message in received:
        assert isinstance(message.payload, bytes)
        ts = msgspec.json.decode(message.payload)["ts"]
        # Dated now (within the run), not on a fixed date that lands far in the past.
        assert before_ms - 10_000 <= ts <= after_ms, (ts, before_ms, after_ms)


async def test_publish_fixed_time_keeps_the_reproducible_dates(mosquitto: Mosquitto) -> None:
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as listener:
        await listener.subscribe("fixed/devices/+/telemetry", qos=1)
        done = await asyncio.to_thread(
            _publish, "--port", str(mosquitto.port), "--prefix", "fixed", "--devices", "1",
            "--messages", "1", "--fixed-time", "--force", "--device-prefix", "lab",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "no gateway checked (--force)" in done.stdout
        async with asyncio.timeout(30):
            message = await anext(aiter(listener.messages))
    assert str(message.topic) == "fixed/devices/lab-00000/telemetry"
    assert isinstance(message.payload, bytes)
    assert msgspec.json.decode(message.payload)["ts"] == EPOCH_MS
