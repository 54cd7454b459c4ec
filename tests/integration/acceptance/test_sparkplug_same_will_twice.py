"""An edge node whose Will is the same bytes every session: Eclipse Tahu's JavaScript client
(npm ``sparkplug-client`` 3.2.4) builds its NDEATH once, when the client is made, and mqtt.js
registers it again at every reconnect (bdSeq 0, the same timestamp). When such an edge node
loses its network twice, the second Will is a new death of a new session, not a redelivery of
the first: the node and its devices must go offline again. Through a TCP proxy that cuts the
edge node's link (the broker publishes its Will), a real mosquitto, daemon and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib

import aiomqtt
import asyncpg

from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.sparkplug_edge import edge_node
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

SPARKPLUG = """
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["Plant1"]
"""

NODE_METRICS = [{"name": "Uptime", "alias": 1, "type": "Int64", "value": 7}]
OVEN_METRICS = [{"name": "temp", "alias": 10, "type": "Double", "value": 20.5}]
DEATHS = "gateway_sparkplug_messages_total"


async def _presence(dsn: str, device: str) -> str | None:
    conn = await asyncpg.connect(dsn)
    try:
        value = await conn.fetchval("SELECT presence FROM device WHERE device_id = $1", device)
    finally:
        await conn.close()
    return None if value is None else str(value)


async def _born(dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return bool(
            await conn.fetchval(
                "SELECT born FROM sparkplug_node WHERE group_id = 'Plant1'"
                " AND edge_node_id = 'Line4'"
            )
        )
    finally:
        await conn.close()


async def test_a_tahu_edge_node_losing_its_link_twice_goes_offline_twice(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG)
    wills: list[bytes] = []

    async def watch(client: aiomqtt.Client) -> None:
        async for message in client.messages:
            wills.append(bytes(message.payload))  # type: ignore[arg-type]

    async with (
        running_daemon(config) as daemon,
        TcpProxy("127.0.0.1", mosquitto.port) as proxy,
        aiomqtt.Client("127.0.0.1", mosquitto.port) as watcher,
    ):
        await watcher.subscribe("spBv1.0/Plant1/NDEATH/Line4", qos=1)
        watching = asyncio.create_task(watch(watcher))
        try:
            async with edge_node(proxy.port, "Plant1", "Line4") as edge:
                for session in (1, 2):
                    if session == 2:
                        await proxy.resume()  # mqtt.js reconnects with the same Will
                        await edge.wait_for(lambda: edge.count("connected") >= 2, "reconnecting")
                    await edge.send("nbirth", metrics=NODE_METRICS)
                    await edge.send("dbirth", device="Oven", metrics=OVEN_METRICS)

                    async def online() -> bool:
                        return (
                            await _presence(db_dsn, "Plant1/Line4") == "online"
                            and await _presence(db_dsn, "Plant1/Line4/Oven") == "online"
                        )

                    await wait_until(online, message=f"session {session} born")
                    await proxy.cut()  # no DISCONNECT: the broker publishes the Will

                    def judged(count: int = session) -> bool:
                        return metric(daemon, DEATHS, {"type": "NDEATH"}) >= count

                    await wait_until(judged, message=f"the Will of session {session} judged")
                    assert await _presence(db_dsn, "Plant1/Line4") == "offline", session
                    assert await _presence(db_dsn, "Plant1/Line4/Oven") == "offline", session
                    assert not await _born(db_dsn), session
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
    # The two Wills were the same bytes: what the host must not take for a redelivery.
    assert len(wills) == 2
    assert wills[0] == wills[1]
