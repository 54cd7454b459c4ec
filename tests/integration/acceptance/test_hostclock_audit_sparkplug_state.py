"""After a power cut, a node whose wall clock came back at 1970 states the host online with a
timestamp the edge nodes take.

A site's power goes: the edge host (a Raspberry Pi, no RTC) that runs the broker and the gateway
goes down at once, the Sparkplug edge nodes (PLCs, on their own supply) stay up. Mosquitto
comes back with what its persistence file held (not the host's last STATE: it was never
saved), and the gateway with its clock at 1970 until NTP syncs. Its STATE birth took the
node's clock: ``{"online": true, "timestamp": <1970>}``, older than the birth the edge nodes
accepted before the cut, and an edge node following Sparkplug 3.0 ignores an online STATE
older than the last one it took: it went on waiting for its primary host, its births held back,
no data and no alarm from it, until the link reconnected for some other reason. The STATE's
time is the database's clock as the node estimates it (measured before the link's first
connect), as every other time the gateway goes by.

Real ``gateway run`` processes (the second under libfaketime, its monotonic clock right),
a real mosquitto killed and started again, real PostgreSQL. The edge node's view (the last
online STATE it accepted) is read by an MQTT client on the STATE topic.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiomqtt
import pytest

from protocol import sparkplug
from tests.support.daemon import DaemonProcess, config_toml, http_healthy
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
pytestmark = pytest.mark.skipif(
    not LIBFAKETIME.exists(), reason=f"{LIBFAKETIME} is missing (libfaketime: .ci/run installs it)"
)
SPARKPLUG = """
[sparkplug]
enabled = true
host_id = "site-gw"
groups = ["Plant1"]
"""
TOPIC = sparkplug.state_topic("site-gw")
AT_1970 = {
    "LD_PRELOAD": str(LIBFAKETIME),
    "FAKETIME": "@1970-01-01 00:00:00",
    "FAKETIME_DONT_FAKE_MONOTONIC": "1",
}


async def _online_state(port: int, daemon: DaemonProcess) -> int:
    """The timestamp of the first online STATE an edge node subscribing now reads."""
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        assert daemon.alive(), f"the daemon exited:\n{daemon.log_tail()}"
        try:
            async with aiomqtt.Client("127.0.0.1", port) as edge:
                await edge.subscribe(TOPIC, qos=1)
                async with asyncio.timeout(2):
                    async for message in edge.messages:
                        state = sparkplug.parse_state(bytes(message.payload))  # type: ignore[arg-type]
                        if state is not None and state[0]:
                            return state[1]
        except TimeoutError:
            pass
        assert asyncio.get_running_loop().time() < deadline, "no online STATE"


async def test_a_node_back_at_1970_after_a_power_cut_states_a_birth_the_edge_nodes_take(
    db_dsn: str, tmp_path: Path
) -> None:
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    http_port = free_port()
    config = tmp_path / "gw.toml"
    config.write_text(
        config_toml(
            dsn=db_dsn, mqtt_port=broker.port, node_id="site", http_port=http_port, extra=SPARKPLUG
        )
    )
    before = DaemonProcess(config, tmp_path / "before.log")
    after = DaemonProcess(config, tmp_path / "after.log", AT_1970)
    try:
        before.start()
        # The birth the edge nodes accepted before the cut (the clock right then).
        accepted = await _online_state(broker.port, before)
        # The power cut: the broker and the gateway go at once (no Will reaches anyone).
        broker.kill()
        before.kill()
        broker.start()

        after.start()

        async def healthy() -> bool:
            assert after.alive(), f"the daemon exited:\n{after.log_tail()}"
            return await http_healthy(http_port)

        await wait_until(healthy, timeout=60, message="the node back, its clock at 1970")
        birth = await _online_state(broker.port, after)
    finally:
        after.cleanup()
        before.cleanup()
        broker.kill()
    assert "node_clock_skew" in after.log_text()  # its clock was at 1970 indeed
    # Sparkplug 3.0: an edge node ignores an online STATE older than the last one it took.
    assert birth >= accepted, (birth, accepted)
