"""A Sparkplug device's out-of-service events on MQTT. The outbox publishes a device's events to
`{prefix}/events/device/{id}`; the topic builder refused an id holding `/` (a Sparkplug id,
`{group}/{node}/{device}`) with a ValueError the publisher did not catch: the daemon stopped at
the first such event, and, the event still unpublished in the outbox, stopped again at each
restart. The id's levels are the topic's levels now: `iot/events/device/Plant1/Line4/Oven`."""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import aiohttp
import aiomqtt
import asyncpg
import msgspec

from tests.support.api_client import OPERATOR, ApiClient
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port

OVEN = "Plant1/Line4/Oven"
TOKENS = f"""
[[api.tokens]]
name = "olga"
token = "{OPERATOR}"
role = "operator"
"""


async def _next_event(subscriber: aiomqtt.Client) -> tuple[str, dict[str, object]]:
    async with asyncio.timeout(30):
        async for message in subscriber.messages:
            body = msgspec.json.decode(bytes(message.payload))  # type: ignore[arg-type]  # bytes on the wire
            return str(message.topic), body
    raise AssertionError("the subscription ended")


async def test_a_sparkplug_devices_out_of_service_events_reach_mqtt_and_the_daemon_runs_on(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "INSERT INTO device (device_id, first_seen, last_seen) VALUES ($1, now(), now())", OVEN
        )
    finally:
        await conn.close()
    port = free_port()
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=TOKENS)
    async with (
        aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="operator-app") as subscriber,
        running_daemon(config),
        aiohttp.ClientSession() as http,
    ):
        await subscriber.subscribe("iot/events/#", qos=1)
        api = ApiClient(base=f"http://127.0.0.1:{port}", http=http)
        path = f"/device/out-of-service?id={quote(OVEN, safe='')}"
        put = await api.call("PUT", path, json={"reason": "door seal"}, token=OPERATOR)
        assert put.status == 200, put.body
        topic, event = await _next_event(subscriber)
        assert topic == f"iot/events/device/{OVEN}"
        assert (event["event_type"], event["aggregate_id"]) == ("device.out_of_service", OVEN)
        # The node still runs: the period's end is published too.
        ended = await api.call("DELETE", path, token=OPERATOR)
        assert ended.status == 200, ended.body
        topic, event = await _next_event(subscriber)
        assert (topic, event["event_type"]) == (f"iot/events/device/{OVEN}", "device.in_service")
