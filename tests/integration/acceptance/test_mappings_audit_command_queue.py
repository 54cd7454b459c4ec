"""Audit: a vendor device (Tasmota, Shelly...) sends no receipt the gateway understands, so its
command stays `SENT` (the broker's PUBACK) until `[commands] sent_timeout_s`, 24 h
(docs/devices.md, "Commands to mapped devices"). But the claim counted those `SENT` commands as
in flight against `[commands] max_in_flight_per_device` (1 by default): after its first command
a plug took no other for a day. "ON" went out, the "OFF" a minute later waited `PENDING`
behind it. Here two nodes of a `$share` group take commands to a Tasmota plug and a Shelly
relay: each command goes out once, in the order given, and ends `SENT`.
"""

from __future__ import annotations

import asyncio
from typing import Final

import aiohttp
import aiomqtt
import asyncpg

from tests.support.api_client import OPERATOR, ApiClient
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

CONFIG: Final = f"""
[[api.tokens]]
token = "{OPERATOR}"
role = "operator"
name = "ops"

[[ingest.mappings]]
name = "tasmota"
profile = "tasmota"

[[ingest.mappings]]
name = "shelly"
profile = "shelly-gen2"

[commands]
ack_window_s = 0.2
reaper_interval_s = 0.2
"""
PLUG: Final = "plug-1"
RELAY: Final = "shellyplus1-a8032ab12345"


async def test_each_command_to_a_vendor_device_goes_out_after_the_one_before(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    configs = [
        make_config(
            dsn=db_dsn,
            mqtt_port=port,
            node_id=node,
            mqtt_extra='shared_group = "gateways"',
            extra=CONFIG,
        )
        for node in ("node-0", "node-1")
    ]
    commands = [
        (PLUG, "POWER", {"value": "ON"}),
        (RELAY, "Switch.Set", {"id": 0, "on": True}),
        (PLUG, "POWER", {"value": "OFF"}),
        (RELAY, "Switch.Set", {"id": 0, "on": False}),
        (PLUG, "POWER", {"value": "ON"}),
    ]
    async with (
        running_daemon(configs[0]) as first,
        running_daemon(configs[1]) as second,
        aiomqtt.Client("127.0.0.1", port, identifier="devices") as devices,
    ):
        await devices.subscribe(f"cmnd/{PLUG}/#", qos=1)
        await devices.subscribe(f"{RELAY}/rpc", qos=1)
        await devices.publish(
            f"tele/{PLUG}/SENSOR", b'{"Time":"2026-12-07T08:00:00","ENERGY":{"Power":0}}', qos=1
        )
        await devices.publish(
            f"{RELAY}/events/rpc",
            b'{"method":"NotifyStatus","params":{"ts":1796630400.5,"switch:0":{"output":false}}}',
            qos=1,
        )

        async def both_mapped() -> bool:
            return bool(await db.fetchval("SELECT count(*) FROM device_mapping") == 2)

        await wait_until(both_mapped, timeout=30, message="both devices read")
        ids = []
        async with aiohttp.ClientSession() as http:
            for number, (device, name, params) in enumerate(commands):
                node = (first, second)[number % 2]
                api = ApiClient(base=f"http://127.0.0.1:{node.http_port}", http=http)
                reply = await api.call(
                    "POST",
                    f"/devices/{device}/commands",
                    token=OPERATOR,
                    json={"name": name, "params": params},
                )
                assert reply.status == 201, reply.body
                ids.append(reply.body["command"]["id"])
        received: list[tuple[str, bytes]] = []
        try:
            async with asyncio.timeout(20):
                async for message in devices.messages:
                    received.append((message.topic.value, bytes(message.payload)))  # type: ignore[arg-type]
                    if len(received) == len(commands):
                        break
        except TimeoutError:
            pass
        statuses = await db.fetch("SELECT id, status FROM command ORDER BY id")
        assert len(received) == len(commands), (
            f"commands left behind the first SENT one: {[dict(r) for r in statuses]}"
        )
    plug = [payload for topic, payload in received if topic == f"cmnd/{PLUG}/POWER"]
    assert plug == [b"ON", b"OFF", b"ON"]
    relay = [payload for topic, payload in received if topic == f"{RELAY}/rpc"]
    assert [b'"on":true' in r for r in relay] == [True, False]
    assert [b'"on":false' in r for r in relay] == [False, True]
    # SENT is the last thing the gateway can know of a vendor device's command.
    assert {r["status"] for r in await db.fetch("SELECT status FROM command")} == {"SENT"}
