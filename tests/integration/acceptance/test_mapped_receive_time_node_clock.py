"""A reading without a time of its own is dated on the database's clock, whichever node read it.

A fridge's sensor behind Zigbee2MQTT sends `{"temperature": 4.1}` with no time: the gateway
dates it when the node read it off the broker (docs/devices.md, "the receive time"). Two nodes
share the devices; one of them has had its NTP broken for a while and runs 4 minutes behind the
database and the other node (inside `reorder_window_s`, so nothing calls it a clock reset).

Node A stores a reading of 4.1 °C. The fridge's door is left open, and the next reading, 12.5
°C, comes through node B: dated by B's clock, it was 4 minutes older than the reading before
it, a late sample of a reordering between nodes, and the fridge too warm right now raised no
alarm that stood (nothing for 4 minutes, for every reading B read). Real mosquitto, real
PostgreSQL, two real daemons; node B's wall clock is set back (tests/support/skewed_gateway.py).
"""

from __future__ import annotations

from pathlib import Path

import aiomqtt
import asyncpg

from tests.support.daemon import (
    DaemonProcess,
    config_toml,
    count_rows,
    http_healthy,
    make_config,
    running_daemon,
)
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.skewed_gateway import SKEW_ENV
from tests.support.waiting import wait_until

FRIDGE = """
[[ingest.mappings]]
name = "z2m"
topic = "z2m/{device}"
[[ingest.mappings.metrics]]
path = "$.temperature"
name = "temp"

[[rules]]
key = "fridge-warm"
kind = "threshold"
metric = "temp"
op = ">"
value = 8
severity = "CRITICAL"
"""


async def _reading(port: int, temperature: float) -> None:
    async with aiomqtt.Client("127.0.0.1", port, identifier="z2m-bridge") as bridge:
        await bridge.publish("z2m/fridge-1", f'{{"temperature": {temperature}}}', qos=1)


async def test_a_reading_read_by_a_node_whose_clock_is_behind_raises_its_alarm(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    node_a = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-a", extra=FRIDGE)
    async with running_daemon(node_a):
        await _reading(mosquitto.port, 4.1)
        await wait_until(lambda: _stored(db_dsn, 1), message="node A stored the first reading")

    http_port = free_port()
    config = tmp_path / "node-b.toml"
    config.write_text(
        config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-b",
                    http_port=http_port, extra=FRIDGE)
    )  # fmt: skip
    node_b = DaemonProcess(
        config, tmp_path / "node-b.log", {SKEW_ENV: "-240"}, module="tests.support.skewed_gateway"
    )

    async def healthy() -> bool:
        assert node_b.alive(), f"node B exited:\n{node_b.log_tail()}"
        return await http_healthy(http_port)

    try:
        node_b.start()
        await wait_until(healthy, timeout=60, message="node B healthy")
        await _reading(mosquitto.port, 12.5)
        await wait_until(lambda: _stored(db_dsn, 2), message="node B stored the warm reading")
    finally:
        node_b.terminate()
        node_b.cleanup()
    alarms = await db.fetch(
        "SELECT status, cleared_at, active_key FROM alarm WHERE rule_key = 'fridge-warm'"
    )
    assert [(a["status"], a["cleared_at"], a["active_key"]) for a in alarms] == [
        ("NEW", None, "fridge-1:fridge-warm")
    ]
    readings = await db.fetch("SELECT ts, metrics->>'temp' AS temp FROM telemetry ORDER BY ts")
    assert [r["temp"] for r in readings] == ["4.1", "12.5"], readings


async def _stored(dsn: str, n: int) -> bool:
    return await count_rows(dsn) >= n
