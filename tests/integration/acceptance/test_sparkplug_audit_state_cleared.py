"""Audit: the host's retained STATE cleared while a node serves it (``mosquitto_pub -r -n -t
spBv1.0/STATE/<host_id>``, a client's "delete retained", a clean-up script sweeping retained
topics). The broker then holds no STATE: an edge node connecting from then on (a new one, or one
back from a network blip) that has this host as its primary host finds none, and per Sparkplug
3.0 waits for an online STATE before its births, which never came while the node served on. The
serving link ignored the empty message (no STATE it could parse). It now states its birth again
(the same timestamp, as for an older offline STATE: edge nodes connected change nothing). Real
STATE link (gateway.sparkplug.state) on a real mosquitto."""

from __future__ import annotations

import asyncio

import aiomqtt
import pytest

from protocol import sparkplug
from tests.integration.acceptance.test_sparkplug_state_retained_offline import (
    TOPIC,
    _state_link,
)
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


async def _retained(port: int) -> tuple[bool, int] | None:
    """The STATE an edge node connecting now reads first: the retained one (None: none within
    two seconds; a retained message comes right after the SUBACK)."""
    async with aiomqtt.Client("127.0.0.1", port) as edge:
        await edge.subscribe(TOPIC, qos=1)
        try:
            async with asyncio.timeout(2):
                async for message in edge.messages:
                    if not message.retain:
                        return None  # published as it subscribed: look again
                    return sparkplug.parse_state(bytes(message.payload))  # type: ignore[arg-type]
        except TimeoutError:
            return None
    return None


@pytest.mark.parametrize("protocol", [aiomqtt.ProtocolVersion.V311, aiomqtt.ProtocolVersion.V5])
async def test_a_cleared_state_is_stated_again_while_the_node_serves(
    mosquitto: Mosquitto, protocol: aiomqtt.ProtocolVersion
) -> None:
    link = _state_link(mosquitto.port, "node-1", protocol)
    stop = asyncio.Event()
    run = asyncio.create_task(link.run(stop))
    try:
        await wait_until(lambda: link.online, message="the node's birth")
        born = link.timestamp
        assert born is not None
        assert await _retained(mosquitto.port) == (True, born)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="sweeper") as tool:
            await tool.publish(TOPIC, b"", qos=1, retain=True)
        read: list[tuple[bool, int] | None] = []

        async def an_edge_connecting_now_reads_online() -> bool:
            read.append(await _retained(mosquitto.port))
            return read[-1] == (True, born)

        await wait_until(
            an_edge_connecting_now_reads_online,
            timeout=15,
            message="the retained STATE online again after it was cleared",
        )
        assert link.online
        assert link.births == 1
        assert link.timestamp == born
    finally:
        stop.set()
        await run
