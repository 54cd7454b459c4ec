"""A rebirth is no death: between an edge node's `NBIRTH` and its devices' `DBIRTH`s, the devices
the node had are not offline. Each `NBIRTH` voids its devices' births, and they used to be set
offline at once, until their own `DBIRTH` set them online again; where the two are committed
apart (another batch, another node of a `$share` group, an edge node of many devices sending
its births one after another), an inactivity pass in between raised "presence offline" for a
device that never went away, and the rebirth that followed cleared it: a page for nothing, at
every rebirth the gateway asks for (each seq gap). A device the new session does not birth is
offline once the node's births are over: at its first data message, or `births_grace_s` after
its `NBIRTH`.

Eclipse Tahu's JavaScript edge node (`sparkplug-client` 3.2.4), a real mosquitto and daemon."""

from __future__ import annotations

from datetime import timedelta

from gateway.sparkplug.rebirth import BIRTHS_GRACE_S
from tests.integration.acceptance.test_sparkplug import (
    NODE_METRICS,
    OVEN_METRICS,
    SPARKPLUG,
    _alarms,
    _node,
    _presence,
    _rows,
)
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.sparkplug_edge import EdgeNode, edge_node
from tests.support.waiting import wait_until

RULES = """
[alarms]
timer_interval_s = 0.5

[[rules]]
key = "plant-gone"
kind = "inactivity"
silent_seconds = 600
severity = "MAJOR"
devices = "Plant1/*"
"""


async def test_devices_between_a_rebirths_nbirth_and_their_dbirth_raise_no_presence_alarm(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Line4 and its Oven are born; Line4 is born again (a rebirth: `NBIRTH`), its `DBIRTH`
    held back. Line9, another edge node, dies then: once its alarm is raised, an inactivity
    pass has run after the rebirth's `NBIRTH` was stored. The Oven raised nothing, and stays
    online through its `DBIRTH`."""
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG + RULES)
    async with (
        running_daemon(config),
        edge_node(mosquitto.port, "Plant1", "Line4") as line4,
        edge_node(mosquitto.port, "Plant1", "Line9") as line9,
    ):
        await line4.send("nbirth", metrics=NODE_METRICS)
        await line4.send("dbirth", device="Oven", metrics=OVEN_METRICS)
        await line9.send("nbirth", metrics=NODE_METRICS)

        async def born() -> bool:
            return (
                await _presence(db_dsn, "Plant1/Line4/Oven") == "online"
                and await _presence(db_dsn, "Plant1/Line9") == "online"
            )

        await wait_until(born, timeout=30, message="Line4's Oven and Line9 born")
        first = await _node(db_dsn, "Plant1", "Line4")
        assert first is not None
        await line4.send("nbirth", metrics=NODE_METRICS)

        async def reborn() -> bool:
            node = await _node(db_dsn, "Plant1", "Line4")
            return node is not None and node.born_at != first.born_at

        await wait_until(reborn, timeout=30, message="the rebirth's NBIRTH stored")
        line9.kill()  # its Will, the NDEATH

        async def line9_alarmed() -> bool:
            return len(await _alarms(db_dsn, "Plant1/Line9")) == 1

        await wait_until(line9_alarmed, timeout=60, message="a pass raised Line9's alarm")
        assert await _alarms(db_dsn, "Plant1/Line4/Oven") == []
        assert await _presence(db_dsn, "Plant1/Line4/Oven") == "online"
        await line4.send("dbirth", device="Oven", metrics=OVEN_METRICS)
        temp = [{"name": "temp", "type": "Double", "value": 21.0}]
        await line4.send("ddata", device="Oven", metrics=temp)

        async def data_stored() -> bool:
            node = await _node(db_dsn, "Plant1", "Line4")
            return node is not None and node.seq is not None and node.seq >= 2

        await wait_until(data_stored, timeout=30, message="the DBIRTH and DDATA stored")
        assert await _alarms(db_dsn, "Plant1/Line4/Oven") == []
        assert await _presence(db_dsn, "Plant1/Line4/Oven") == "online"


PUMP_METRICS = [{"name": "flow", "alias": 20, "type": "Double", "value": 1.5}]


async def _born_with_oven_and_pump(db_dsn: str, line4: EdgeNode) -> None:
    await line4.send("nbirth", metrics=NODE_METRICS)
    await line4.send("dbirth", device="Oven", metrics=OVEN_METRICS)
    await line4.send("dbirth", device="Pump", metrics=PUMP_METRICS)

    async def born() -> bool:
        return all(
            [await _presence(db_dsn, f"Plant1/Line4/{d}") == "online" for d in ("Oven", "Pump")]
        )

    await wait_until(born, timeout=30, message="the Oven and the Pump born")


async def test_a_device_the_rebirth_does_not_bear_is_offline_at_the_nodes_first_data(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Line4 had an Oven and a Pump; born again, it births the Oven only, then sends data: the
    births are over, the Pump is gone (offline, its inactivity alarm raised), the Oven is not."""
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG + RULES)
    async with running_daemon(config), edge_node(mosquitto.port, "Plant1", "Line4") as line4:
        await _born_with_oven_and_pump(db_dsn, line4)
        await line4.send("nbirth", metrics=NODE_METRICS)
        await line4.send("dbirth", device="Oven", metrics=OVEN_METRICS)
        await line4.send("ndata", metrics=[{"name": "Uptime", "type": "Int64", "value": 8}])

        async def pump_gone() -> bool:
            return len(await _alarms(db_dsn, "Plant1/Line4/Pump")) == 1

        await wait_until(pump_gone, timeout=30, message="the Pump's inactivity alarm")
        assert await _presence(db_dsn, "Plant1/Line4/Pump") == "offline"
        assert await _presence(db_dsn, "Plant1/Line4/Oven") == "online"
        assert await _alarms(db_dsn, "Plant1/Line4/Oven") == []
        state = await _node(db_dsn, "Plant1", "Line4")
        assert state is not None
        assert state.devices == ["Oven"]


async def test_a_device_the_rebirth_does_not_bear_is_offline_once_the_grace_has_passed(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """As above, but Line4 sends nothing after the Oven's DBIRTH (an edge node that reports by
    exception): the Pump is offline once BIRTHS_GRACE_S has passed since the NBIRTH, set so by
    the rebirth loop, never before."""
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG + RULES)
    async with running_daemon(config), edge_node(mosquitto.port, "Plant1", "Line4") as line4:
        await _born_with_oven_and_pump(db_dsn, line4)
        await line4.send("nbirth", metrics=NODE_METRICS)
        await line4.send("dbirth", device="Oven", metrics=OVEN_METRICS)

        async def pump_gone() -> bool:
            return await _presence(db_dsn, "Plant1/Line4/Pump") == "offline"

        await wait_until(pump_gone, timeout=BIRTHS_GRACE_S + 30, message="the Pump offline")
        (row,) = await _rows(
            db_dsn,
            "SELECT d.presence_at - s.born_at AS after, s.unborn FROM device d, sparkplug_node s"
            " WHERE d.device_id = 'Plant1/Line4/Pump'",
        )
        assert row["after"] >= timedelta(seconds=BIRTHS_GRACE_S)
        assert row["unborn"] == []

        async def pump_alarmed() -> bool:
            return len(await _alarms(db_dsn, "Plant1/Line4/Pump")) == 1

        await wait_until(pump_alarmed, timeout=30, message="the Pump's inactivity alarm")
        assert await _presence(db_dsn, "Plant1/Line4/Oven") == "online"
        assert await _alarms(db_dsn, "Plant1/Line4/Oven") == []
