"""The live stream with real daemons on one database: every node's stream carries every node's
events, a ticket from one node opens a stream on another, and a stream resumes after its
daemon restarts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import aiomqtt
import asyncpg
import msgspec

from gateway.config import parse_config
from protocol import Topics
from tests.support.api_client import OPERATOR, VIEWER
from tests.support.daemon import config_toml, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.sse import Sse, SseStream, open_stream

T0 = 1_767_225_600_000
RULES = f"""
[[rules]]
key = "door"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
description = "A door opened: someone is in the cabinet."

[[api.tokens]]
token = "{OPERATOR}"
role = "operator"
name = "night-shift"
"""


@contextlib.contextmanager
def _broker(directory: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(directory)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def _config(dsn: str, broker: Mosquitto, node_id: str) -> str:
    return config_toml(dsn=dsn, mqtt_port=broker.port, node_id=node_id, extra=RULES)


async def _door(broker: Mosquitto, device: str, k: int) -> None:
    payload = msgspec.json.encode({"ts": T0 + k * 1000, "events": [{"type": "DOOR_OPEN"}]})
    async with aiomqtt.Client("127.0.0.1", broker.port) as client:
        await client.publish(Topics("iot").telemetry(device), payload, qos=1)


async def _alarm_created(stream: SseStream) -> Sse:
    while True:
        event = await stream.next(timeout=60)
        if event.event == "alarm.created":
            return event


async def test_a_node_streams_what_another_node_did_and_resumes_after_a_restart(
    db_dsn: str, tmp_path: Path
) -> None:
    # Each node has its own broker: what is published on B's is ingested by node B only.
    with _broker(tmp_path / "a") as broker_a, _broker(tmp_path / "b") as broker_b:
        config_a = parse_config(_config(db_dsn, broker_a, "node-a"))
        config_b = parse_config(_config(db_dsn, broker_b, "node-b"))
        async with aiohttp.ClientSession() as http, running_daemon(config_b) as node_b:
            base_b = f"http://127.0.0.1:{node_b.http_port}"
            async with running_daemon(config_a) as node_a:
                base_a = f"http://127.0.0.1:{node_a.http_port}"
                async with http.post(
                    f"{base_b}/stream/tickets", headers={"Authorization": f"Bearer {OPERATOR}"}
                ) as reply:
                    assert reply.status == 201
                    ticket = (await reply.json())["ticket"]
                # B's ticket opens A's stream.
                async with open_stream(http, base_a, ticket=ticket) as stream:
                    await stream.live()
                    await _door(broker_b, "cabinet-1", 0)
                    seen = await _alarm_created(stream)
            alarm = seen.data["payload"]["alarm"]
            assert (alarm["device_id"], alarm["rule_key"]) == ("cabinet-1", "door")
            assert seen.data["aggregate_id"] == str(alarm["id"])
            assert alarm["rule_description"] == "A door opened: someone is in the cabinet."
            assert alarm["trigger"] == {
                "event": "DOOR_OPEN",
                "sample_ts": "2026-01-01T00:00:00+00:00",
            }
            node = await _node_of(db_dsn, alarm["id"])
            assert node == "node-b"

            # Node A is down; B raises another alarm; A comes back and its client resumes.
            await _door(broker_b, "cabinet-2", 1)
            async with running_daemon(config_a) as node_a:
                base_a = f"http://127.0.0.1:{node_a.http_port}"
                async with open_stream(
                    http, base_a, token=OPERATOR, last_event_id=seen.id
                ) as stream:
                    missed = await _alarm_created(stream)
            assert missed.data["payload"]["alarm"]["device_id"] == "cabinet-2"


async def _node_of(dsn: str, alarm_id: int) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        node: str = await conn.fetchval("SELECT node_id FROM alarm WHERE id = $1", alarm_id)
        return node
    finally:
        await conn.close()


async def _cut(stream: SseStream) -> list[str]:
    """Read until the server ends the stream (a reset or an end); the lines it sent meanwhile."""
    lines = []
    with contextlib.suppress(aiohttp.ClientError):
        async with asyncio.timeout(30):
            while line := await stream.response.content.readline():
                lines.append(line.decode())
    return [line for line in lines if line.strip() and not line.startswith(":")]


async def test_a_reload_that_removes_or_rotates_a_token_cuts_its_streams_and_voids_its_tickets(
    db_dsn: str, tmp_path: Path
) -> None:
    wall = f"""
[[api.tokens]]
token = "{VIEWER}"
role = "viewer"
name = "wall-screen"
"""
    with _broker(tmp_path) as broker:
        config = parse_config(_config(db_dsn, broker, "node-a") + wall)
        async with aiohttp.ClientSession() as http, running_daemon(config) as node:
            base = f"http://127.0.0.1:{node.http_port}"
            hub = node.services.stream_hub
            assert hub is not None
            async with http.post(
                f"{base}/stream/tickets", headers={"Authorization": f"Bearer {VIEWER}"}
            ) as reply:
                assert reply.status == 201
                ticket = (await reply.json())["ticket"]
            async with (
                open_stream(http, base, token=VIEWER) as viewer,
                open_stream(http, base, token=OPERATOR) as operator,
            ):
                await viewer.live()
                await operator.live()
                # What SIGHUP does, with the wall-screen token gone from the file.
                node.reload(parse_config(_config(db_dsn, broker, "node-a")))
                assert await _cut(viewer) == []  # ended at once, nothing more sent
                assert hub.streams == 1
                async with http.get(f"{base}/stream", params={"ticket": ticket}) as reply:
                    assert reply.status == 401
                    assert (await reply.json())["error"] == "UNAUTHORIZED"
                # The token that stays keeps its stream: it still gets what happens.
                await _door(broker, "cabinet-1", 0)
                seen = await _alarm_created(operator)
                assert seen.data["payload"]["alarm"]["device_id"] == "cabinet-1"

                # The operator's token rotated under the same name: its stream ends too.
                rotated = _config(db_dsn, broker, "node-a").replace(OPERATOR, "rotated-" + OPERATOR)
                node.reload(parse_config(rotated))
                await _cut(operator)
                assert hub.streams == 0
            assert metric(node, "gateway_streams_dropped_total", {"reason": "revoked"}) == 2
            assert metric(node, "gateway_streams_open") == 0
