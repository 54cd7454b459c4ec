"""``[mqtt] hosts``: two real mosquitto brokers as the endpoints of one broker.

Two standalone brokers share nothing: what the first one acknowledged to a publisher and had
not delivered to the gateway when it died dies with it (that is what a cluster sharing its
sessions is for: docs/deploying.md, "Several broker endpoints"). What these tests assert is
what is true with standalone brokers: every message the second broker acknowledged to its
publisher is stored exactly once, nothing is stored twice, the gateway moves at once and says
so in one line, and /health and /metrics name the endpoint in use.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import aiomqtt
import asyncpg
import msgspec
import pytest

from gateway.config import Config
from gateway.domain.errors import StartupError
from gateway.runtime.daemon import Daemon
from protocol import Topics
from protocol import sparkplug as sparkplug_wire
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream
from tests.support.daemon import (
    READY_TIMEOUT_S,
    DaemonProcess,
    config_toml,
    make_config,
    metric,
    running_daemon,
    scrape,
)
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
DEVICES = device_ids(20)
FIRST, HELD, SECOND = 500, 3000, 2000


async def _health(port: int) -> dict[str, object]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/health") as response,
    ):
        body = await response.json()
        body["status_code"] = response.status
        return dict(body)


async def _stored(dsn: str, low: int, high: int) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM telemetry WHERE seq >= $1 AND seq < $2", low, high
            )
        )
    finally:
        await conn.close()


def _records(process: DaemonProcess, event: str) -> list[dict[str, object]]:
    lines = []
    for line in process.log_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("event") == event:
                lines.append(entry)
    return lines


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_the_first_broker_killed_mid_stream_the_gateway_carries_on_with_the_second(
    db_dsn: str, tmp_path: Path, protocol: str
) -> None:
    first = Mosquitto(tmp_path / "broker-a")
    second = Mosquitto(tmp_path / "broker-b")
    a, b = f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(
            dsn=db_dsn,
            mqtt_port=0,
            mqtt_hosts=[a, b],
            node_id="endpoints-node",
            protocol=protocol,
            http_port=http_port,
            log_level="info",
            # A small window: what the first broker holds for the gateway stays in the broker
            # while the gateway's batches wait (3.1.1: mosquitto's max_inflight_messages, 20).
            mqtt_extra="receive_maximum = 100",
            ingest_extra="read_buffer = 100\nqueue_max = 100",
        )
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    stream = list(telemetry_stream(TOPICS, DEVICES, FIRST + HELD + SECOND))
    blocker = await asyncpg.connect(db_dsn)
    first.start()
    second.start()
    try:
        process.start()

        async def on(endpoint: str) -> bool:
            assert process.alive(), f"daemon exited:\n{process.log_tail()}"
            try:
                health = await _health(http_port)
            except aiohttp.ClientError:
                return False
            broker = health["broker"]
            assert isinstance(broker, dict)
            return health["status_code"] == 200 and broker["endpoint"] == endpoint

        await wait_until(lambda: on(a), timeout=60, message="healthy on the first endpoint")
        health = await _health(http_port)
        assert health["broker"] == {
            "ok": True,
            "subscribed": True,
            "address": ["127.0.0.1", first.port],
            "endpoint": a,
            "endpoints": [a, b],
            "connections": 1,
        }
        async with aiomqtt.Client("127.0.0.1", first.port, max_inflight_messages=200) as pub:
            await publish_many(pub, stream[:FIRST], window=200)
            await wait_until(
                lambda: _stored_all(db_dsn, 0, FIRST), timeout=60, message="the first part stored"
            )
            # The gateway's next batch waits on this lock inside its transaction: the kill
            # lands with messages received and not committed, and more queued in the broker.
            held = blocker.transaction()
            await held.start()
            await blocker.execute("LOCK TABLE telemetry IN EXCLUSIVE MODE")
            # Every one of these is PUBACKed by the first broker to the publisher.
            await publish_many(pub, stream[FIRST : FIRST + HELD], window=200)

        async def writer_blocked() -> bool:
            waiting = await blocker.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            return bool(waiting)

        await wait_until(writer_blocked, timeout=60, message="a batch waiting on the lock")
        first.kill()  # SIGKILL: its queue (autosave off) dies with it
        await held.rollback()
        await wait_until(lambda: on(b), timeout=30, message="healthy on the second endpoint")

        async with aiomqtt.Client("127.0.0.1", second.port, max_inflight_messages=200) as pub:
            # Every one of these is PUBACKed by the second broker: each must be stored.
            await publish_many(pub, stream[FIRST + HELD :], window=200)
        total = FIRST + HELD + SECOND
        await wait_until(
            lambda: _stored_all(db_dsn, FIRST + HELD, total),
            timeout=90,
            message="every message the second broker acknowledged stored",
        )
        series = await scrape(http_port)
        assert series[f'gateway_mqtt_endpoint{{endpoint="{b}"}}'] == 1.0
        assert series[f'gateway_mqtt_endpoint{{endpoint="{a}"}}'] == 0.0
        assert series["gateway_mqtt_endpoint_switches_total"] == 1.0
        assert process.terminate() == 0
    finally:
        await blocker.close()
        process.cleanup()
        first.kill()
        second.stop()

    conn = await asyncpg.connect(db_dsn)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM telemetry")
        distinct = await conn.fetchval("SELECT count(DISTINCT seq) FROM telemetry")
    finally:
        await conn.close()
    held_stored = await _stored(db_dsn, FIRST, FIRST + HELD)
    # Nothing twice; the first part and everything the second broker acknowledged, whole.
    assert rows == distinct
    assert await _stored(db_dsn, 0, FIRST) == FIRST
    assert await _stored(db_dsn, FIRST + HELD, total) == SECOND
    # What the first broker acknowledged to the publisher and still held for the gateway
    # when it was killed is lost with it (a standalone broker shares no session); what the
    # gateway had received by then was stored (its PUBACK went nowhere).
    assert 0 < held_stored < HELD, held_stored
    # One line for the move: which endpoint, from which, and why.
    (switch,) = _records(process, "broker_endpoint_switched")
    assert switch["endpoint"] == b
    assert switch["previous"] == a
    assert switch["reason"]
    # The loss itself, as for one broker, naming the key to check.
    lost = _records(process, "broker_unavailable")
    assert lost
    assert all(r["port"] == first.port and r["setting"] == "[mqtt] hosts" for r in lost), lost
    assert switch["session_present"] in (False, None)  # a new session on the second broker


async def _retained(port: int, topic: str, within_s: float = 10) -> bytes:
    async with aiomqtt.Client("127.0.0.1", port) as client:
        await client.subscribe(topic, qos=1)
        async with asyncio.timeout(within_s):
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                return message.payload
    raise AssertionError("no retained message")


async def _stored_all(dsn: str, low: int, high: int) -> bool:
    return await _stored(dsn, low, high) == high - low


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_the_sparkplug_host_state_follows_the_session_to_the_second_broker(
    db_dsn: str, tmp_path: Path, protocol: str
) -> None:
    """Edge nodes on the second broker must see the host's birth once the gateway serves them
    from there: the STATE link connects where the session is, not to the first endpoint."""
    first = Mosquitto(tmp_path / "broker-a")
    second = Mosquitto(tmp_path / "broker-b")
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(
            dsn=db_dsn,
            mqtt_port=0,
            mqtt_hosts=[f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"],
            node_id="state-node",
            protocol=protocol,
            http_port=http_port,
            log_level="info",
            extra='[sparkplug]\nenabled = true\nhost_id = "gw-host"\ngroups = ["Plant1"]\n',
        )
    )
    topic = sparkplug_wire.state_topic("gw-host")
    process = DaemonProcess(config, tmp_path / "daemon.log")
    first.start()
    second.start()
    try:
        process.start()

        async def online_on(port: int) -> bool:
            assert process.alive(), f"daemon exited:\n{process.log_tail()}"
            try:
                state = sparkplug_wire.parse_state(await _retained(port, topic))
            except (TimeoutError, aiomqtt.MqttError):
                return False
            return state is not None and state[0]

        await wait_until(lambda: online_on(first.port), timeout=60, message="STATE on the first")
        # Nothing on the second broker yet: the link is where the session is.
        with pytest.raises(TimeoutError):
            await _retained(second.port, topic, within_s=1)
        first.kill()
        await wait_until(
            lambda: online_on(second.port), timeout=60, message="STATE online on the second"
        )
        assert process.terminate() == 0
        # A clean stop says offline where the link was: on the second broker.
        state = sparkplug_wire.parse_state(await _retained(second.port, topic))
        assert state is not None
        assert state[0] is False
    finally:
        process.cleanup()
        first.kill()
        second.stop()


def _backoff(config: Config, low: float, high: float) -> Config:
    mqtt = msgspec.structs.replace(config.mqtt, reconnect_min_s=low, reconnect_max_s=high)
    return msgspec.structs.replace(config, mqtt=mqtt)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_dead_first_endpoint_at_start_costs_the_second_no_backoff(
    db_dsn: str, mosquitto: Mosquitto, protocol: str
) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: refused at once
    live = f"127.0.0.1:{mosquitto.port}"
    # A backoff of at least 100 s: one waited before the second endpoint would outlast the
    # deadline below (the start's own) by far.
    config = _backoff(
        make_config(dsn=db_dsn, mqtt_port=0, mqtt_hosts=[dead, live], protocol=protocol),
        200,
        200,
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with running_daemon(config) as daemon:
        took = loop.time() - started
        session = daemon.session
        assert session is not None
        assert session.backoff.attempt == 0  # no delay was ever drawn
        assert session.endpoint == ("127.0.0.1", mosquitto.port)
        assert metric(daemon, "gateway_mqtt_connects_total", {"outcome": "error"}) == 1
        healthy, body = await daemon.health()
        assert healthy
        assert body.broker.endpoint == live
        assert body.broker.endpoints == [dead, live]
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, telemetry_stream(TOPICS, DEVICES, 10))
        await wait_until(lambda: _stored_all(db_dsn, 0, 10), timeout=30, message="stored")
    assert took < READY_TIMEOUT_S < 100, took


async def test_the_backoff_is_waited_once_per_round_over_the_endpoints(db_dsn: str) -> None:
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    config = _backoff(make_config(dsn=db_dsn, mqtt_port=0, mqtt_hosts=dead), 0.01, 0.02)
    daemon = Daemon(config)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:

        def errors() -> float:
            return metric(daemon, "gateway_mqtt_connects_total", {"outcome": "error"})

        await wait_until(lambda: errors() >= 12, timeout=READY_TIMEOUT_S, message="4 rounds")
        session = daemon.session
        assert session is not None
        # Read in one step of the loop: each failure counted and its delay drawn together.
        failed, drawn = errors(), session.backoff.attempt
        assert drawn == int(failed) // 3, (failed, drawn)
        assert not daemon.ready.is_set()
        healthy, body = await daemon.health()
        assert not healthy
        assert body.reason is not None
        assert body.reason.startswith(f"connecting to the broker at any of {dead[0]}, ")
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await task


async def test_a_reload_follows_a_changed_endpoint_list(db_dsn: str, tmp_path: Path) -> None:
    with Mosquitto(tmp_path / "a") as first, Mosquitto(tmp_path / "b") as second:
        a, b = f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"

        def config(hosts: list[str]) -> Config:
            return make_config(dsn=db_dsn, mqtt_port=0, mqtt_hosts=hosts)

        async with running_daemon(config([a])) as daemon:
            session = daemon.session
            assert session is not None
            # The endpoint in use is still listed: the connection stays.
            daemon.reload(config([b, a]))
            assert session.endpoints == (("127.0.0.1", second.port), ("127.0.0.1", first.port))
            assert session.endpoint == ("127.0.0.1", first.port)
            assert session.connected
            assert session.connections == 1
            # Not listed any more: the connection is made again on the new list.
            daemon.reload(config([b]))
            await wait_until(
                lambda: session.subscribed and session.endpoint == ("127.0.0.1", second.port),
                timeout=30,
                message="subscribed on the second broker",
            )
            assert session.connections == 2
            # Left cleanly: the broker left behind says the node is offline (no Will fired).
            assert await _retained(first.port, TOPICS.gateway_status("test-node")) == b"offline"
            assert await _retained(second.port, TOPICS.gateway_status("test-node")) == b"online"
            async with aiomqtt.Client("127.0.0.1", second.port) as pub:
                await publish_many(pub, telemetry_stream(TOPICS, DEVICES, 10))
            await wait_until(lambda: _stored_all(db_dsn, 0, 10), timeout=30, message="stored")
            # No broker of its own any more: the embedded one is started at start only, so the
            # node keeps its endpoints (mqtt_endpoints_not_reloaded), and a later reload works.
            none = config([b])
            daemon.reload(
                msgspec.structs.replace(none, mqtt=msgspec.structs.replace(none.mqtt, hosts=[]))
            )
            assert session.endpoints == (("127.0.0.1", second.port),)
            daemon.reload(config([b, a]))
            assert session.endpoints == (("127.0.0.1", second.port), ("127.0.0.1", first.port))
            assert session.connections == 2
            healthy, body = await daemon.health()
            assert healthy
            assert body.broker.endpoint == b
            assert body.broker.endpoints == [b, a]


async def test_an_endpoint_refusing_the_connection_at_start_moves_on_to_the_next(
    db_dsn: str, tmp_path: Path
) -> None:
    # Anonymous clients refused: the CONNACK says "not authorized" (final for one endpoint).
    closed = "allow_anonymous false"
    with (
        Mosquitto(tmp_path / "refusing-1", extra_config=closed) as refusing,
        Mosquitto(tmp_path / "refusing-2", extra_config=closed) as refusing_too,
        Mosquitto(tmp_path / "open") as accepting,
    ):
        bad, worse = f"127.0.0.1:{refusing.port}", f"127.0.0.1:{refusing_too.port}"
        good = f"127.0.0.1:{accepting.port}"
        config = make_config(dsn=db_dsn, mqtt_port=0, mqtt_hosts=[bad, good])
        async with running_daemon(config) as daemon:
            session = daemon.session
            assert session is not None
            assert session.endpoint == ("127.0.0.1", accepting.port)
            assert metric(daemon, "gateway_mqtt_connects_total", {"outcome": "error"}) == 1
        # Refused by every endpoint: the start fails, naming the setting (exit 2).
        refused = Daemon(make_config(dsn=db_dsn, mqtt_port=0, mqtt_hosts=[bad, worse]))
        with pytest.raises(StartupError) as caught:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await refused.run(asyncio.Event())
    assert caught.value.configuration
    assert f"the broker at {worse} refused the connection" in str(caught.value)
    assert metric(refused, "gateway_mqtt_connects_total", {"outcome": "error"}) == 2


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_an_ipv6_endpoint_in_brackets(db_dsn: str, tmp_path: Path, protocol: str) -> None:
    v6_port = free_port()
    extra = f"listener {v6_port} ::1"
    with Mosquitto(tmp_path / "v6", extra_config=extra) as broker:
        dead = f"127.0.0.1:{free_port()}"
        v6 = f"[::1]:{v6_port}"
        config = make_config(dsn=db_dsn, mqtt_port=0, mqtt_hosts=[dead, v6], protocol=protocol)
        async with running_daemon(config) as daemon:
            healthy, body = await daemon.health()
            assert healthy
            assert body.broker.endpoint == v6
            assert body.broker.address == ("::1", v6_port)
            # Through the broker's IPv4 listener: the same broker, so the message reaches the
            # gateway connected over IPv6.
            async with aiomqtt.Client("127.0.0.1", broker.port) as pub:
                await publish_many(pub, telemetry_stream(TOPICS, DEVICES, 10))
            await wait_until(lambda: _stored_all(db_dsn, 0, 10), timeout=30, message="stored")


async def test_sighup_follows_a_changed_list_and_refuses_host_beside_hosts(
    db_dsn: str, tmp_path: Path
) -> None:
    with Mosquitto(tmp_path / "a") as first, Mosquitto(tmp_path / "b") as second:
        a, b = f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"
        http_port = free_port()
        config = tmp_path / "gateway.toml"

        def write(hosts: list[str], extra: str = "") -> None:
            config.write_text(
                config_toml(
                    dsn=db_dsn,
                    mqtt_port=0,
                    mqtt_hosts=hosts,
                    http_port=http_port,
                    log_level="info",
                    mqtt_extra=extra,
                )
            )

        write([a])
        process = DaemonProcess(config, tmp_path / "daemon.log")
        try:
            process.start()

            async def on(endpoint: str) -> bool:
                assert process.alive(), f"daemon exited:\n{process.log_tail()}"
                try:
                    health = await _health(http_port)
                except aiohttp.ClientError:
                    return False
                broker = health["broker"]
                assert isinstance(broker, dict)
                return health["status_code"] == 200 and broker["endpoint"] == endpoint

            await wait_until(lambda: on(a), timeout=60, message="healthy on the first broker")
            # Invalid: refused whole, the node stays where it is.
            write([b], extra='host = "127.0.0.1"')
            process.signal(signal.SIGHUP)
            await wait_until(
                lambda: bool(_records(process, "config_reload_refused")),
                timeout=30,
                message="the reload refused",
            )
            assert await on(a)
            write([b])
            process.signal(signal.SIGHUP)
            await wait_until(lambda: on(b), timeout=30, message="healthy on the second broker")
            assert process.terminate() == 0
        finally:
            process.cleanup()
    (refused,) = _records(process, "config_reload_refused")
    assert "mqtt.hosts: set [mqtt] host or [mqtt] hosts, not both" in str(refused["error"])
    (changing,) = _records(process, "mqtt_endpoints_changing")
    assert changing["endpoint"] == a
    assert changing["configured"] == [b]
