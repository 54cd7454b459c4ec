"""The host's STATE follows the ingest session to another broker when a reload moves it
(``[mqtt] hosts`` changed, SIGHUP: the broker in use no longer listed), not only when the broker
in use dies.

The STATE link stayed connected to the broker left behind, which is still up: there the
retained STATE kept saying the host is online (Sparkplug 3.0 edge nodes on it published into a
broker nobody consumed from, instead of holding their data for the host), and on the broker
the gateway now serves from there was no STATE at all (edge nodes with this host as their
primary host never published their births there).

A real daemon and two mosquittos."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiomqtt

from gateway.config import Config
from protocol import sparkplug
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

SPARKPLUG = '[sparkplug]\nenabled = true\nhost_id = "gw-host"\ngroups = ["Plant1"]\n'
TOPIC = sparkplug.state_topic("gw-host")


async def _state_on(port: int) -> tuple[bool, int] | None:
    """The retained STATE on the broker at ``port`` (None: none within a second)."""
    async with aiomqtt.Client("127.0.0.1", port) as client:
        await client.subscribe(TOPIC, qos=1)
        try:
            async with asyncio.timeout(1):
                async for message in client.messages:
                    assert isinstance(message.payload, bytes)
                    return sparkplug.parse_state(message.payload)
        except TimeoutError:
            return None
    return None


async def test_the_host_state_moves_with_a_reload_off_a_live_broker(
    db_dsn: str, tmp_path: Path
) -> None:
    with Mosquitto(tmp_path / "a") as first, Mosquitto(tmp_path / "b") as second:

        def config(port: int) -> Config:
            return make_config(
                dsn=db_dsn, mqtt_port=0, mqtt_hosts=[f"127.0.0.1:{port}"], extra=SPARKPLUG
            )

        async def online_on(port: int) -> bool:
            state = await _state_on(port)
            return state is not None and state[0]

        async with running_daemon(config(first.port)) as daemon:
            session = daemon.session
            assert session is not None
            await wait_until(lambda: online_on(first.port), timeout=30, message="STATE on a")
            daemon.reload(config(second.port))
            await wait_until(
                lambda: session.subscribed and session.endpoint == ("127.0.0.1", second.port),
                timeout=30,
                message="the session subscribed on the second broker",
            )
            try:
                await wait_until(
                    lambda: online_on(second.port),
                    timeout=15,
                    message="the host's STATE online on the broker the session moved to",
                )
            finally:
                left = await _state_on(first.port)
            # The broker left behind says the host is offline there (a clean stop's STATE).
            assert left is not None
            assert left[0] is False, f"still online on the broker left behind: {left}"
