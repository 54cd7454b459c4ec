"""The simulator takes its broker from the gateway's config file, with the gateway's defaults."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiomqtt

from gateway.config import Config
from sim.gateway_config import Broker, broker_of
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
