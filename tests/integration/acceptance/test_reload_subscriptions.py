"""A reload that changes ``[mqtt] shared_group`` or ``topic_prefix`` takes effect at once
(issue 28): the node makes its broker connection again with the new filters, unsubscribes the
old ones from its persistent session, and every part that names a topic (ingest, downlinks,
events, presence) follows. Two nodes on the same devices, real mosquitto (both protocol
versions) and amqtt (MQTT 3.1.1 without shared subscriptions: a reload asking for one is
refused loudly and survived, not obeyed into silence).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Final

import aiohttp
import aiomqtt
import asyncpg
import pytest

from gateway.config import Config
from gateway.embedded.broker import EmbeddedBroker
from gateway.runtime.components import subscriptions
from gateway.runtime.daemon import Daemon
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

SHARED: Final = 'shared_group = "gateways"'
API: Final = f'[[api.tokens]]\ntoken = "{OPERATOR}"\nrole = "operator"\nname = "ops"\n'
RECEIVED: Final = "gateway_telemetry_received_total"
NODES: Final = ("node-0", "node-1")


def _sample(n: int) -> bytes:
    return b'{"ts": %d, "metrics": {"t": 1.5}}' % (1_767_225_600_000 + n)


def _configs(dsn: str, port: int, protocol: str, mqtt_extra: str) -> list[Config]:
    return [
        make_config(
            dsn=dsn,
            mqtt_port=port,
            node_id=node,
            protocol=protocol,
            mqtt_extra=mqtt_extra,
            extra=API,
        )
        for node in NODES
    ]


@contextlib.asynccontextmanager
async def _two(configs: list[Config]) -> AsyncIterator[tuple[Daemon, Daemon]]:
    async with running_daemon(configs[0]) as first, running_daemon(configs[1]) as second:
        yield first, second


async def _reloaded(daemons: tuple[Daemon, ...], configs: list[Config]) -> None:
    """Reload each node, then wait until each is subscribed again under the new filters."""
    for daemon, config in zip(daemons, configs, strict=True):
        daemon.reload(config)

    def settled() -> bool:
        for daemon, config in zip(daemons, configs, strict=True):
            session = daemon.session
            assert session is not None
            wanted = tuple(subscriptions(config, session.settings.protocol))
            if not session.subscribed or session.subscriptions != wanted:
                return False
        return True

    await wait_until(settled, timeout=30, message="both nodes subscribed again")


async def _publish(port: int, messages: list[tuple[str, bytes]], protocol: str) -> None:
    version = aiomqtt.ProtocolVersion.V5 if protocol == "5" else aiomqtt.ProtocolVersion.V311
    async with aiomqtt.Client(
        "127.0.0.1", port, identifier="reload-device", protocol=version
    ) as device:
        for topic, payload in messages:
            await device.publish(topic, payload, qos=1)


async def _stored(db: asyncpg.Connection, expected: int) -> None:
    async def done() -> bool:
        return bool(await db.fetchval("SELECT count(*) FROM telemetry") == expected)

    await wait_until(done, timeout=60, message=f"{expected} messages stored")


def _received(daemons: tuple[Daemon, ...]) -> list[float]:
    return [metric(d, RECEIVED) for d in daemons]


def _duplicates(daemons: tuple[Daemon, ...]) -> list[float | None]:
    return [
        d.metrics.registry.get_sample_value("gateway_telemetry_duplicates_total") for d in daemons
    ]


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_reload_that_turns_on_shared_group_shares_the_stream_at_once(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, protocol: str
) -> None:
    """Before: each node subscribes on its own, so both receive every message. After the
    reload: each message reaches one node only (the plain filters are gone from both
    persistent sessions), none is lost or stored twice, and neither node reconnected more
    than the once the reload asked for."""
    port = mosquitto.port
    async with _two(_configs(db_dsn, port, protocol, "")) as daemons:
        await _publish(port, [("iot/devices/dev-1/telemetry", _sample(0))], protocol)
        await _stored(db, 1)
        await wait_until(lambda: _received(daemons) == [1.0, 1.0], message="both received it")

        await _reloaded(daemons, _configs(db_dsn, port, protocol, SHARED))
        before = _received(daemons)
        duplicates_before = _duplicates(daemons)  # the first message reached both nodes
        count = 200
        await _publish(
            port,
            [(f"iot/devices/dev-{n % 7}/telemetry", _sample(n + 1)) for n in range(count)],
            protocol,
        )
        await _stored(db, count + 1)

        def shares() -> list[float]:
            return [after - was for after, was in zip(_received(daemons), before, strict=True)]

        def drained() -> bool:
            # The received counter moves after the commit returns, so a row can be visible
            # to this test a moment before its node has counted it.
            queues = all(d.writer is not None and d.writer.queue.qsize() == 0 for d in daemons)
            return queues and sum(shares()) >= count

        await wait_until(drained, message=f"both queues empty and {count} counted")
        assert sum(shares()) == count, shares()  # each message to one node: nothing twice
        assert _duplicates(daemons) == duplicates_before  # none stored twice, none redelivered
        assert all(share > 0 for share in shares()), shares()  # shared out, not one node's
        assert await db.fetchval("SELECT count(*) FROM dead_letter") == 0
        for daemon in daemons:
            assert daemon.session is not None
            assert daemon.session.connections == 2  # the start, and the reload's remake
        remembered = await db.fetch(
            "SELECT client_id, topic_filter FROM mqtt_subscription ORDER BY 1, 2"
        )
        assert {(r[0], r[1]) for r in remembered} == {
            (f"gateway-{node}", topic)
            for node in NODES
            for topic in (
                "$share/gateways/iot/devices/+/telemetry",
                "$share/gateways/iot/devices/+/acks",
                "iot/devices/+/status",
            )
        }


async def test_a_reload_to_a_new_prefix_moves_ingest_downlinks_and_presence(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """Two nodes in one group, prefix ``site-a`` then (reload) ``site-b``: telemetry under
    ``site-b`` is stored and under ``site-a`` reaches no node (it was dead-lettered as
    BAD_TOPIC when the change waited for a restart); a command goes out under ``site-b``;
    each node's retained presence says ``online`` under ``site-b`` and ``offline`` under
    ``site-a``."""
    port = mosquitto.port
    extra = 'topic_prefix = "site-a"\n' + SHARED
    async with _two(_configs(db_dsn, port, "5", extra)) as daemons:
        await _reloaded(daemons, _configs(db_dsn, port, "5", extra.replace("site-a", "site-b")))
        async with aiomqtt.Client("127.0.0.1", port, identifier="reload-device-1") as device:
            await device.subscribe("site-b/devices/dev-1/commands", qos=1)
            await device.subscribe("+/gateways/+/status", qos=1)
            await device.publish("site-a/devices/dev-1/telemetry", _sample(1), qos=1)
            await device.publish("site-b/devices/dev-1/telemetry", _sample(2), qos=1)
            await _stored(db, 1)
            async with aiohttp.ClientSession() as http:
                api = ApiClient(base=f"http://127.0.0.1:{daemons[0].http_port}", http=http)
                created = await api.call(
                    "POST", "/devices/dev-1/commands", token=OPERATOR, json={"name": "set"}
                )
                assert created.status in (200, 201, 202), created.body
            presence: dict[str, bytes] = {}
            command_topic = None
            async with asyncio.timeout(30):
                async for message in device.messages:
                    topic = str(message.topic)
                    assert isinstance(message.payload, bytes)
                    if topic.endswith("/commands"):
                        command_topic = topic
                    else:
                        presence[topic] = message.payload
                    if command_topic is not None and len(presence) == 2 * len(NODES):
                        break
        assert command_topic == "site-b/devices/dev-1/commands"
        assert presence == {
            **{f"site-a/gateways/{node}/status": b"offline" for node in NODES},
            **{f"site-b/gateways/{node}/status": b"online" for node in NODES},
        }
        assert _received(daemons) == [0.0, 1.0] or _received(daemons) == [1.0, 0.0]
        assert await db.fetchval("SELECT count(*) FROM dead_letter") == 0
        assert await db.fetchval("SELECT device_id FROM telemetry") == "dev-1"


async def test_a_reload_asking_for_what_the_broker_cannot_do_is_refused_loudly_and_undone(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """amqtt (MQTT 3.1.1) takes ``$share/...`` as a plain filter and delivers nothing to it.
    Reloaded with a ``shared_group``, the node does not run on silently: the probe finds it,
    ``/health`` answers 503 naming the setting, the process keeps running; reloaded back, it
    ingests again."""
    broker = EmbeddedBroker("127.0.0.1", free_port())
    await broker.start()
    try:
        plain, shared = (
            make_config(
                dsn=db_dsn,
                mqtt_port=broker.port,
                protocol="3.1.1",
                mqtt_extra=f"{group}\nprobe_timeout_s = 1",
            )
            for group in ("", SHARED)
        )
        async with running_daemon(plain) as daemon, aiohttp.ClientSession() as http:
            session = daemon.session
            assert session is not None
            daemon.reload(shared)

            def refused() -> bool:
                return session.problem is not None and "shared_group" in session.problem

            await wait_until(refused, timeout=30, message="the refusal named")
            health = f"http://127.0.0.1:{daemon.http_port}/health"
            async with http.get(health) as response:
                assert response.status == 503
                assert "shared_group" in await response.text()

            daemon.reload(plain)
            await wait_until(
                lambda: session.subscribed and session.problem is None,
                timeout=30,
                message="subscribed again",
            )
            await _publish(broker.port, [("iot/devices/dev-1/telemetry", _sample(1))], "3.1.1")
            await _stored(db, 1)
            async with http.get(health) as response:
                assert response.status == 200, await response.text()
    finally:
        await broker.stop()
