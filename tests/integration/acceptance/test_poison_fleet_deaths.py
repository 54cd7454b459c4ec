"""A node of a shared subscription learns the deaths the fleet counted (docs/architecture.md,
"Poison messages": "The state is in PostgreSQL, so another node of the shared subscription
counts the same deaths") before it processes a message, not only at its own start: a message
quarantined by one node is quarantined by a node that ran all along, not processed a third time.
"""

from __future__ import annotations

from pathlib import Path

import aiomqtt

from tests.integration.acceptance.test_poison import _wait_healthy, _write_config
from tests.integration.acceptance.test_poison_comes_back import (
    DEADLY_BYTES,
    KILLER,
    _quarantined_arrivals,
    _two_deaths_then_quarantine,
)
from tests.support.daemon import DaemonProcess
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until


async def test_a_killer_quarantined_by_one_node_is_quarantined_by_another_that_never_restarted(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """Two nodes share the telemetry ($share, mosquitto's strict turns). The killer reaches one,
    kills it twice and is quarantined there; the other node ran all along. Then the device
    sends the same message twice more (it never had the broker's PUBACK, say): one copy to
    each node. Neither may die: the deaths are in PostgreSQL, shared by the fleet."""
    ports = [free_port(), free_port()]
    nodes: list[DaemonProcess] = []
    for i, port in enumerate(ports):
        config = tmp_path / f"gateway-{i}.toml"
        _write_config(config, db_dsn, mosquitto.port, port, f"node-{i}")
        config.write_text(
            config.read_text().replace("[mqtt]\n", '[mqtt]\nshared_group = "fleet"\n', 1)
        )
        nodes.append(
            DaemonProcess(
                config, tmp_path / f"daemon-{i}.log", module="tests.support.dying_gateway"
            )
        )
    try:
        for node, port in zip(nodes, ports, strict=True):
            node.start()
            await _wait_healthy(node, port)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(KILLER, DEADLY_BYTES, qos=1)
        await wait_until(
            lambda: not all(n.alive() for n in nodes), timeout=60, message="a node dies"
        )
        victim = next(i for i, n in enumerate(nodes) if not n.alive())
        other = nodes[1 - victim]
        assert other.alive()
        await _two_deaths_then_quarantine(nodes[victim], ports[victim], db_dsn)

        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(KILLER, DEADLY_BYTES, qos=1)
            await pub.publish(KILLER, DEADLY_BYTES, qos=1)

        async def both_copies_or_a_death() -> bool:
            return not all(n.alive() for n in nodes) or await _quarantined_arrivals(db_dsn) >= 3

        await wait_until(both_copies_or_a_death, timeout=60, message="both copies quarantined")
        dead = [f"node-{i} (exit {n.exit_code()})" for i, n in enumerate(nodes) if not n.alive()]
        assert not dead, f"the quarantined message was processed again and killed {dead}"
        for node in nodes:
            assert node.terminate() == 0
    finally:
        for node in nodes:
            node.cleanup()
