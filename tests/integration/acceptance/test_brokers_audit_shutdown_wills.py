"""A mosquitto maintenance restart publishes every connected device's Will.

mosquitto 2.0 (2.0.11 here) sends the Will of every client still connected when it is stopped
(SIGTERM, `systemctl stop mosquitto`: "mosquitto version ... terminating"), then saves its
database: the gateway's persistent session holds each device's `offline`, and so does the
retained status. When the broker is back the gateway reads them first, while the devices are
still in their reconnect backoff (paho's goes up to 120 s). None of those devices died: the
broker going away ended their connections. A presence `offline` read just after a break of
the node's session is therefore taken as the start of a silence (judged by the rule's
`silent_seconds`, listened for), not as the statement a live Will is. mosquitto writes those
Wills to the node's connection before it closes it (the node reads them live, its break
begins just after), and the resumed session and the subscribe's retained statuses deliver
them again after the break: both are within REHEAR_S of the break. A device that dies once
the node listens again is still alarmed at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiomqtt
import asyncpg
import pytest

from gateway.alarms.inactivity import REHEAR_S
from gateway.runtime.daemon import Daemon
from protocol import Topics
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
FLEET = [f"fleet-{n}" for n in range(5)]
RULE = (
    '[[rules]]\nkey = "gone"\nkind = "inactivity"\nsilent_seconds = 3600\nseverity = "MAJOR"\n'
    # Passes only when the test asks for one.
    "[alarms]\ntimer_interval_s = 0.2\n"
)

MARGIN_S = 2.0  # see listened()


@contextlib.asynccontextmanager
async def _device(port: int, device_id: str) -> AsyncIterator[aiomqtt.Client]:
    """A device as the topics contract has it: a retained `offline` Will, `online` at connect,
    one report. Its connection may be ended under it (the broker stopping)."""
    will = aiomqtt.Will(TOPICS.device_status(device_id), b"offline", qos=1, retain=True)
    client = aiomqtt.Client("127.0.0.1", port, identifier=device_id, will=will, keepalive=60)
    await client.__aenter__()
    try:
        await client.publish(TOPICS.device_status(device_id), b"online", qos=1, retain=True)
        await client.publish(
            TOPICS.telemetry(device_id),
            b'{"ts": 1767225600000, "metrics": {"t": 1}}',
            qos=1,
        )
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.__aexit__(None, None, None)
        # The broker ended the connection: its error is the point here, not news.
        ended = client._disconnected
        if ended.done() and not ended.cancelled():
            ended.exception()


async def _presence(db: asyncpg.Connection, devices: list[str], presence: str) -> bool:
    return bool(
        await db.fetchval(
            "SELECT count(*) = cardinality($1::text[]) FROM device"
            " WHERE device_id = ANY($1) AND presence = $2",
            devices,
            presence,
        )
    )


def _subscribed(daemon: Daemon) -> bool:
    return daemon.session is not None and daemon.session.subscribed


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_broker_restart_raises_no_presence_alarm_for_the_fleet(
    db_dsn: str, mosquitto: Mosquitto, protocol: str
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, protocol=protocol, extra=RULE)
    db = await asyncpg.connect(db_dsn)
    try:
        async with running_daemon(config) as daemon, contextlib.AsyncExitStack() as fleet:
            assert daemon.components is not None
            monitor = daemon.components.inactivity
            for device_id in FLEET:
                await fleet.enter_async_context(_device(mosquitto.port, device_id))

            async def online() -> bool:
                return await _presence(db, FLEET, "online")

            await wait_until(online, timeout=30, message="the fleet online")

            mosquitto.stop()  # the maintenance window: every device's Will goes out
            await wait_until(
                lambda: not _subscribed(daemon), timeout=30, message="the session down"
            )
            # mosquitto wrote the Wills to the node's connection before closing it: a pass
            # while the broker is away judges what was read then.
            await monitor.run_once()
            mosquitto.start()
            await wait_until(lambda: _subscribed(daemon), timeout=30, message="subscribed again")

            async def wills_read() -> bool:
                return await _presence(db, FLEET, "offline")

            # The Wills the broker published as it went down, read back from the session.
            await wait_until(wills_read, timeout=30, message="the shutdown's Wills stored")
            # The devices are still in their reconnect backoff: a pass now (the monitor's own
            # passes may have run too).
            await monitor.run_once()
            during = await db.fetch("SELECT device_id, rule_key FROM alarm ORDER BY device_id")
            assert [tuple(r) for r in during] == []

            # A device that dies while the node listens is still a statement, alarmed at once.
            async with (
                TcpProxy("127.0.0.1", mosquitto.port) as proxy,
                _device(proxy.port, "dies"),
            ):

                async def dies_online() -> bool:
                    return await _presence(db, ["dies"], "online")

                await wait_until(dies_online, timeout=30, message="the last device online")

                async def listened() -> bool:
                    # A margin past REHEAR_S: the pass sends its windows as seconds before now,
                    # and a loaded machine's pass reaches its statement a moment after it
                    # measured them, which moves a window's end that much later (a Will read
                    # just past REHEAR_S was taken for the restart's, in one loaded full run).
                    # The link is heard up to now only once the broker answers (as a pass asks).
                    assert daemon.session is not None
                    await daemon.session.confirm_hearing()
                    return daemon.session.hearing(3600).listening_s > REHEAR_S + MARGIN_S

                await wait_until(listened, timeout=30, message="listening again")
                await proxy.cut()

                async def dead() -> bool:
                    return await _presence(db, ["dies"], "offline")

                await wait_until(dead, timeout=30, message="its Will stored")

                await monitor.run_once()
            alarms = await db.fetch("SELECT device_id, rule_key FROM alarm ORDER BY device_id")
    finally:
        await db.close()
    assert [tuple(r) for r in alarms] == [("dies", "gone")]


async def test_a_host_reboot_raises_no_presence_alarm_for_the_fleet(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """The broker and the gateway on one host, rebooted: the gateway stops first (cleanly),
    then mosquitto, publishing every device's Will into the gateway's session and as the
    retained status; at boot the gateway starts and reads them while it subscribes, before
    the devices are back."""
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=RULE)
    db = await asyncpg.connect(db_dsn)
    try:
        async with contextlib.AsyncExitStack() as fleet:
            async with running_daemon(config):
                for device_id in FLEET:
                    await fleet.enter_async_context(_device(mosquitto.port, device_id))

                async def online() -> bool:
                    return await _presence(db, FLEET, "online")

                await wait_until(online, timeout=30, message="the fleet online")
            mosquitto.stop()
            mosquitto.start()
            async with running_daemon(config) as daemon:
                assert daemon.components is not None

                async def wills_read() -> bool:
                    return await _presence(db, FLEET, "offline")

                await wait_until(wills_read, timeout=30, message="the shutdown's Wills stored")
                await daemon.components.inactivity.run_once()
                alarms = await db.fetch("SELECT device_id, rule_key FROM alarm ORDER BY 1")
    finally:
        await db.close()
    assert [tuple(r) for r in alarms] == []
