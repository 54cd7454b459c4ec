"""Several nodes under one ``host_id`` (a ``$share`` group): the node that connected FIRST
stops or dies while a later one still serves. Its offline STATE is older than the serving
node's birth, so edge nodes already connected ignore it (Sparkplug 3.0) — but it is retained,
and replaced the serving node's online STATE on the broker: an edge node connecting from then on
(a new one, or one back from a network blip) reads only that offline STATE, takes its primary
host for offline, and waits for an online STATE before its births, which never came. The
serving node now states its birth again (the same timestamp) when a live offline STATE older
than its birth comes. Real STATE links (gateway.sparkplug.state) on a real mosquitto, one
behind a TCP proxy to crash it."""

from __future__ import annotations

import asyncio

import aiomqtt
import pytest

from gateway.sparkplug.state import HostStateLink
from gateway.support.backoff import Backoff
from protocol import sparkplug
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPIC = sparkplug.state_topic("gw-host")


def _state_link(port: int, client_id: str, protocol: aiomqtt.ProtocolVersion) -> HostStateLink:
    def client(will: aiomqtt.Will) -> aiomqtt.Client:
        return aiomqtt.Client("127.0.0.1", port, identifier=client_id, will=will, protocol=protocol)

    return HostStateLink(host_id="gw-host", client=client, backoff=Backoff(0.05, 0.2))


async def _retained(port: int) -> tuple[bool, int]:
    """The STATE an edge node connecting now reads first: the retained one."""
    async with aiomqtt.Client("127.0.0.1", port) as edge:
        await edge.subscribe(TOPIC, qos=1)
        async with asyncio.timeout(10):
            async for message in edge.messages:
                assert message.retain
                state = sparkplug.parse_state(bytes(message.payload))  # type: ignore[arg-type]
                assert state is not None
                return state
    raise AssertionError("no retained STATE")


@pytest.mark.parametrize("protocol", [aiomqtt.ProtocolVersion.V311, aiomqtt.ProtocolVersion.V5])
@pytest.mark.parametrize("gone", ["crashed", "stopped"])
async def test_an_edge_node_connecting_after_the_first_node_is_gone_finds_the_host_online(
    mosquitto: Mosquitto, gone: str, protocol: aiomqtt.ProtocolVersion
) -> None:
    seen: list[tuple[bool, int]] = []

    async with (
        TcpProxy("127.0.0.1", mosquitto.port) as proxy,
        aiomqtt.Client("127.0.0.1", mosquitto.port) as watcher,
    ):
        await watcher.subscribe(TOPIC, qos=1)

        async def watch() -> None:
            async for message in watcher.messages:
                state = sparkplug.parse_state(bytes(message.payload))  # type: ignore[arg-type]
                if state is not None:
                    seen.append(state)

        watching = asyncio.create_task(watch())
        one = _state_link(proxy.port, "node-1", protocol)
        two = _state_link(mosquitto.port, "node-2", protocol)
        stop_one, stop_two = asyncio.Event(), asyncio.Event()
        runs = [asyncio.create_task(one.run(stop_one))]
        try:
            await wait_until(lambda: one.online, message="node-1's birth")
            runs.append(asyncio.create_task(two.run(stop_two)))
            await wait_until(lambda: two.online, message="node-2's birth")
            first, second = one.timestamp, two.timestamp
            assert first is not None
            assert second is not None
            assert second > first
            await wait_until(lambda: (True, second) in seen, message="node-2's birth seen")
            assert await _retained(mosquitto.port) == (True, second)

            if gone == "crashed":
                await proxy.cut()  # the broker publishes node-1's Will
            else:
                stop_one.set()  # a clean stop: node-1's offline STATE, then DISCONNECT
                await runs[0]
            await wait_until(lambda: (False, first) in seen, message="node-1's offline STATE")
            read: list[tuple[bool, int]] = []

            async def an_edge_connecting_now_reads_online() -> bool:
                read.append(await _retained(mosquitto.port))
                return read[-1] == (True, second)

            await wait_until(
                an_edge_connecting_now_reads_online,
                timeout=10,
                message=f"the retained STATE online (node-2's birth {second}; node-1's {first})",
            )
            # Node-2 stated its birth again, and did not connect again (node-1's death is older).
            assert (True, second) in seen[seen.index((False, first)) + 1 :]
            assert two.online
            assert two.timestamp == second
            assert two.births == 1
        finally:
            stop_one.set()
            stop_two.set()
            await asyncio.gather(*runs)
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
