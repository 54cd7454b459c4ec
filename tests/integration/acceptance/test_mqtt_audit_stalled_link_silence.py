"""A broker link that stalls (a NAT or firewall dropping its state, a radio link gone: the
connection stays open and carries nothing) is seen by the keep-alive only after 1.5 times
``[mqtt] keepalive_s``. Until then the node took itself for listening, and every device whose
reports the stall swallowed looked silent to it: an inactivity rule shorter than that raised an
alarm for each, though each kept reporting to the broker all along."""

from __future__ import annotations

import asyncio
import contextlib

import aiomqtt
import asyncpg
import pytest

from protocol import Topics
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
SILENT_S = 2
KEEPALIVE_S = 8
RULE = (
    f'[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = {SILENT_S}\n'
    'severity = "MAJOR"\n'
)


async def _beacon(port: int, stop: asyncio.Event) -> None:
    """A device reporting to the broker every 0.2 s, straight (not through the proxy)."""
    async with aiomqtt.Client("127.0.0.1", port) as device:
        n = 0
        while not stop.is_set():
            n += 1
            payload = f'{{"ts": {1_767_225_600_000 + n}, "metrics": {{"t": {n}}}}}'
            await device.publish(TOPICS.telemetry("beacon"), payload.encode(), qos=1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_stalled_link_is_not_listening_and_alarms_nobody(
    db_dsn: str, mosquitto: Mosquitto, protocol: str
) -> None:
    db = await asyncpg.connect(db_dsn)
    stop = asyncio.Event()
    async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
        config = make_config(
            dsn=db_dsn,
            mqtt_port=proxy.port,
            protocol=protocol,
            extra=RULE,
            mqtt_extra=f"keepalive_s = {KEEPALIVE_S}",
        )
        beacon: asyncio.Task[None] | None = None
        try:
            async with running_daemon(config) as daemon:
                session = daemon.session
                assert session is not None
                beacon = asyncio.create_task(_beacon(mosquitto.port, stop))

                async def heard() -> bool:
                    return bool(
                        await db.fetchval("SELECT count(*) FROM device WHERE device_id = 'beacon'")
                    )

                await wait_until(heard, timeout=30, message="the beacon heard")
                await wait_until(
                    lambda: session.hearing(SILENT_S).listening_s > 2 * SILENT_S,
                    timeout=30,
                    message="listened for two silences",
                )
                proxy.black_hole()
                await wait_until(
                    lambda: not session.connected,
                    timeout=3 * KEEPALIVE_S,
                    message="the stalled link seen by the keep-alive",
                )
                alarms = await db.fetch(
                    "SELECT device_id, rule_key, triggered_at FROM alarm WHERE device_id = 'beacon'"
                )
                assert alarms == [], (
                    "the beacon kept reporting to the broker through the stall, and was alarmed"
                    f" silent while the node took the stalled link for listening: {alarms}"
                )
                proxy.swallowing = False
                await wait_until(lambda: session.subscribed, timeout=60, message="subscribed again")
        finally:
            stop.set()
            if beacon is not None:
                await beacon
            await db.close()
