"""The broker matrix (issue 28, "Tests"): brokers nobody here wrote, driven by devices nobody
here wrote (paho, MQTT.js), against real ``gateway run`` processes and in-process daemons.

mosquitto (MQTT 5 and 3.1.1) and amqtt are covered by test_broker_capabilities.py,
test_broker_limits.py, test_process.py and test_portable_ids.py; here the same properties on
NATS 2.9 (its ``mqtt`` block, on JetStream) and RabbitMQ 3.10 (its MQTT plugin), both MQTT 3.1.1
only: ingest exactly once across a SIGKILL, a command's round trip, ``$share`` refused, a
refused subscription, an oversized downlink, a changed prefix, device ids with ``.``.

One broker per family for the whole session (a RabbitMQ node takes 10-20 s to boot); every test
isolates itself on it with a topic prefix and a node id (hence client id) of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import shutil
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import asyncpg
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from gateway.domain.command import Delivery
from gateway.mqtt.session import PROBE_DEVICE, PROBE_MARK
from gateway.mqtt.v311_client import ConnectionSettings
from gateway.mqtt.witness import closes_subscribing
from gateway.runtime.components import subscriptions
from protocol import Topics
from sim.telemetry import device_ids, telemetry_stream
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.brokers import (
    RESTRICTED_PASSWORD,
    RESTRICTED_USER,
    Nats,
    RabbitMQ,
    nats_binary,
    rabbit_missing,
)
from tests.support.commands import new_command
from tests.support.daemon import (
    DaemonProcess,
    config_toml,
    count_rows,
    http_healthy,
    make_config,
    running_daemon,
)
from tests.support.gateway_cli import gateway_run
from tests.support.ports import free_port
from tests.support.waiting import wait_until, wait_until_sync

Broker = Nats | RabbitMQ

EXIT_CONFIG: Final = 2
SHARED_SETTING: Final = "[mqtt] shared_group (empty: no shared subscription), or the broker's ACL"
ACL_SETTING: Final = "[mqtt] topic_prefix, or the broker's ACL"
LIMIT: Final = 4096
MESSAGES: Final = 3000
NATS_MAX_ACK_PENDING: Final = 1024  # its mqtt block's default
BROKER_INFLIGHT: Final = {"rabbitmq": 10, "nats": NATS_MAX_ACK_PENDING}
SAMPLE: Final = b'{"ts": 1767225600000, "metrics": {"t": 1.5}}'
COMMANDS: Final = (
    f'[[api.tokens]]\ntoken = "{OPERATOR}"\nrole = "operator"\nname = "ops"\n'
    "[commands]\nlease_s = 2\nack_window_s = 0\nreaper_interval_s = 0.2\n"
)
MQTTJS_DIR: Final = Path(__file__).resolve().parents[2] / "support" / "mqttjs"


# --- the brokers, one per family per session -------------------------------------------------


@pytest.fixture(scope="session")
def nats_broker() -> Iterator[Nats]:
    if nats_binary() is None:
        pytest.skip("nats-server is missing (apt-get install nats-server)")
    # Not under pytest's basetemp: another pytest run may prune it while this session runs.
    workdir = Path(tempfile.mkdtemp(prefix="gw-test-nats-"))
    broker = Nats(workdir)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def rabbit_broker() -> Iterator[RabbitMQ]:
    missing = rabbit_missing()
    if missing:
        pytest.skip(missing)
    workdir = Path(tempfile.mkdtemp(prefix="gw-test-rabbit-"))
    broker = RabbitMQ(workdir)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(params=["nats", "rabbitmq"])
def broker(request: pytest.FixtureRequest) -> Broker:
    name = "nats_broker" if request.param == "nats" else "rabbit_broker"
    found: Broker = request.getfixturevalue(name)
    return found


@pytest.fixture(scope="session")
def mqttjs() -> Path:
    """The MQTT.js publisher (tests/support/mqttjs), its node_modules installed once."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are missing (MQTT.js devices)")
    if not (MQTTJS_DIR / "node_modules" / "mqtt").is_dir():
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=MQTTJS_DIR,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, f"npm ci in {MQTTJS_DIR} failed:\n{done.stderr}"
    return MQTTJS_DIR / "publish.js"


# --- one gateway's own corner of the shared broker ----------------------------------------------


@dataclass
class Corner:
    """A topic prefix and node id of one test's own, on the session's broker."""

    broker: Broker
    uid: str = field(default_factory=lambda: secrets.token_hex(3))

    @property
    def prefix(self) -> str:
        return f"m{self.uid}"

    @property
    def node_id(self) -> str:
        return f"matrix-{self.uid}"

    @property
    def topics(self) -> Topics:
        return Topics(self.prefix)

    def mqtt_extra(self, *lines: str, prefix: str | None = None) -> str:
        """What docs/deploying.md says to set for the broker, plus ``lines`` (which may set
        probe_timeout_s, 5 s otherwise)."""
        probe = (
            [] if any(x.startswith("probe_timeout_s") for x in lines) else ["probe_timeout_s = 5"]
        )
        return "\n".join(
            [
                f'topic_prefix = "{prefix or self.prefix}"',
                f'broker_family = "{self.broker.family}"',
                # The broker's window: RabbitMQ's mqtt.prefetch, NATS's mqtt.max_ack_pending.
                f"broker_inflight = {BROKER_INFLIGHT[self.broker.family]}",
                *probe,
                *lines,
            ]
        )

    def toml(self, dsn: str, *lines: str, **kwargs: Any) -> str:
        prefix = kwargs.pop("prefix", None)
        return config_toml(
            dsn=dsn,
            mqtt_port=self.broker.port,
            node_id=self.node_id,
            protocol="3.1.1",
            mqtt_extra=self.mqtt_extra(*lines, prefix=prefix),
            **kwargs,
        )


@pytest.fixture
def corner(broker: Broker) -> Corner:
    return Corner(broker)


# --- devices nobody here wrote -----------------------------------------------------------------


def _paho(port: int, client_id: str) -> paho.Client:
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=paho.MQTTv311,
        clean_session=True,
    )
    connected = threading.Event()
    client.on_connect = lambda *_: connected.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    if not connected.wait(10):
        client.loop_stop()
        raise AssertionError(f"paho did not connect to 127.0.0.1:{port}")
    return client


def _paho_publish(port: int, messages: list[tuple[str, bytes]], client_id: str) -> list[bool]:
    """Publish each message at QoS 1 on one paho connection; whether each was acknowledged
    (False: the broker closed the connection instead; the rest are not sent)."""
    client = _paho(port, client_id)
    closed = threading.Event()
    client.on_disconnect = lambda *_: closed.set()
    acked = []
    try:
        for topic, payload in messages:
            if closed.is_set():
                acked.append(False)
                continue
            info = client.publish(topic, payload, qos=1)
            wait_until_sync(
                lambda info=info: info.is_published() or closed.is_set(),  # type: ignore[misc]
                timeout=10,
                message=f"PUBACK or close for {topic}",
            )
            acked.append(info.is_published())
    finally:
        client.disconnect()
        client.loop_stop()
    return acked


async def publish(port: int, messages: list[tuple[str, bytes]], client_id: str) -> list[bool]:
    return await asyncio.to_thread(_paho_publish, port, messages, client_id)


class PahoDevice:
    """A device on paho: receives its downlinks and answers each with a receipt (docs/commands.md,
    "Receipt protocol"), echoing commandId, claimGeneration and nodeId."""

    def __init__(self, port: int, topics: Topics, device_id: str) -> None:
        self.topics = topics
        self.device_id = device_id
        self.downlinks: list[dict[str, Any]] = []
        self._subscribed = threading.Event()
        self.client = _paho(port, f"{topics.prefix}-{device_id}")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.subscribe(topics.commands(device_id), qos=1)
        if not self._subscribed.wait(10):
            raise AssertionError("the device's subscription was not acknowledged")

    def _on_message(
        self, client: paho.Client, _userdata: object, message: paho.MQTTMessage
    ) -> None:
        downlink = json.loads(message.payload)
        self.downlinks.append(downlink)
        receipt = {
            "commandId": downlink["commandId"],
            "claimGeneration": downlink["claimGeneration"],
            "nodeId": downlink["nodeId"],
            "result": "ACKED",
            "resultCode": 0,
            "rawAck": f"done by paho on {self.device_id}",
        }
        client.publish(self.topics.acks(self.device_id), json.dumps(receipt), qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# --- helpers -----------------------------------------------------------------------------------


async def _wait_healthy(process: DaemonProcess, port: int) -> None:
    async def ready() -> bool:
        assert process.alive(), f"daemon exited:\n{process.log_tail()}"
        return await http_healthy(port)

    await wait_until(ready, timeout=60, message="daemon healthy")


def _records(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def _scalar(dsn: str, sql: str, *args: object) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def _api(port: int | None) -> AsyncIterator[ApiClient]:
    assert port is not None
    async with aiohttp.ClientSession() as http:
        yield ApiClient(base=f"http://127.0.0.1:{port}", http=http)


# --- the matrix --------------------------------------------------------------------------------


@dataclass
class Crash:
    """A ``gateway run`` SIGKILLed while MQTT.js publishes; every message published."""

    process: DaemonProcess
    http_port: int
    at_kill: int


async def _crash_mid_stream(
    corner: Corner,
    mqttjs: Path,
    db_dsn: str,
    tmp_path: Path,
    *lines: str,
    batch_max: int = 20,
    kill_when: Callable[[], Awaitable[bool]] | None = None,
) -> Crash:
    """``kill_when``: the moment of the SIGKILL (by default, a tenth of the stream stored)."""
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        corner.toml(
            db_dsn,
            *lines,
            http_port=http_port,
            ingest_extra=f"batch_max = {batch_max}\nlinger_ms = 0",
        )
    )
    stream = list(telemetry_stream(corner.topics, device_ids(20), MESSAGES))
    stream_file = tmp_path / "stream.jsonl"
    stream_file.write_text(
        "".join(json.dumps({"topic": t, "payload": p.decode()}) + "\n" for t, p in stream)
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    publisher: asyncio.subprocess.Process | None = None
    try:
        process.start()
        await _wait_healthy(process, http_port)
        publisher = await asyncio.create_subprocess_exec(
            "node", str(mqttjs), str(corner.broker.port), str(stream_file), "100",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip

        async def stored_some() -> bool:
            return await count_rows(db_dsn) >= MESSAGES // 10

        await wait_until(kill_when or stored_some, timeout=60, message="the moment to kill")
        process.kill()
        at_kill = await count_rows(db_dsn)
        assert at_kill < MESSAGES, "the kill must land in the middle of the stream"
        async with asyncio.timeout(120):
            out, _ = await publisher.communicate()
        assert publisher.returncode == 0, out.decode()
        assert out.decode().strip() == f"published {MESSAGES}"
    except BaseException:
        process.cleanup()
        raise
    finally:
        if publisher is not None and publisher.returncode is None:
            publisher.kill()
            await publisher.wait()
    return Crash(process, http_port, at_kill)


@pytest.fixture
def crash_broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Broker]:
    """RabbitMQ: the session's node. NATS: one of the test's own whose ``mqtt.ack_wait`` is
    below the gateway's ``probe_timeout_s`` (see test_nats_holds_back_a_crashed_sessions_...):
    the rule docs/deploying.md gives, at a scale a test can wait for."""
    if request.param == "rabbitmq":
        yield request.getfixturevalue("rabbit_broker")
        return
    if nats_binary() is None:
        pytest.skip("nats-server is missing (apt-get install nats-server)")
    broker = Nats(tmp_path / "nats", mqtt_extra='  ack_wait: "3s"')
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.mark.parametrize("crash_broker", ["nats", "rabbitmq"], indirect=True)
async def test_ingest_exactly_once_across_a_sigkill(
    crash_broker: Broker, mqttjs: Path, db_dsn: str, tmp_path: Path
) -> None:
    """MQTT.js publishes 3,000 messages; the gateway is SIGKILLed mid-stream and restarted;
    the broker's persistent session holds what it had not acknowledged: each stored once."""
    corner = Corner(crash_broker)
    crash = await _crash_mid_stream(corner, mqttjs, db_dsn, tmp_path, "probe_timeout_s = 8")
    process = crash.process
    try:
        process.start()
        await _wait_healthy(process, crash.http_port)

        async def all_stored() -> bool:
            return await count_rows(db_dsn) >= MESSAGES

        await wait_until(all_stored, timeout=120, message="every message stored after restart")
        assert process.terminate() == 0
    finally:
        process.cleanup()
    conn = await asyncpg.connect(db_dsn)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM telemetry")
        seqs = await conn.fetchval("SELECT count(DISTINCT seq) FROM telemetry")
        dead = await conn.fetchval("SELECT count(*) FROM dead_letter")
    finally:
        await conn.close()
    assert (rows, seqs, dead) == (MESSAGES, MESSAGES, 0), f"stored {crash.at_kill} at the kill"


async def test_nats_holds_back_a_crashed_sessions_deliveries_for_its_ack_wait(
    nats_broker: Nats, mqttjs: Path, db_dsn: str, tmp_path: Path
) -> None:
    """NATS (defaults: ``mqtt.max_ack_pending`` 1024, ``mqtt.ack_wait`` 30 s) keeps the
    messages a SIGKILLed gateway had received and not acknowledged pending until their
    ack_wait runs out; with max_ack_pending of them pending it delivers nothing else to the
    session meanwhile, the gateway's probe included. A gateway restarted at once used to take
    its subscription for unproven and exit 2 blaming the ACL (under systemd,
    ``RestartPreventExitStatus=2``: never restarted). At start an unproven subscription is now
    probed again for 4 probe timeouts (40 s by default) before the node gives up: the node
    waits out ack_wait, unhealthy and saying why, then stores everything exactly once.

    The probe runs at that restart because the filters are recorded unproven, as every filter
    is after the upgrade to migration 0038 (a node whose record holds the proof resumes the
    session without probing: test_resumed_session)."""
    corner = Corner(nats_broker)

    async def at_max_ack_pending() -> bool:
        pending = await asyncio.to_thread(nats_broker.ack_pending)
        return max(pending.values(), default=0) >= NATS_MAX_ACK_PENDING

    # Slow storing, fast reading: killed once the gateway holds max_ack_pending unacknowledged.
    crash = await _crash_mid_stream(
        corner,
        mqttjs,
        db_dsn,
        tmp_path,
        "probe_timeout_s = 10",  # the default: 4 tries outlast the 30 s ack_wait
        batch_max=5,
        kill_when=at_max_ack_pending,
    )
    conn = await asyncpg.connect(db_dsn)
    try:  # as a database migrated to 0038 finds them: remembered, never proven
        await conn.execute("UPDATE mqtt_subscription SET proven_at = NULL")
    finally:
        await conn.close()
    process = crash.process
    try:
        process.start()

        async def all_stored() -> bool:
            assert process.alive(), process.log_tail()
            return await count_rows(db_dsn) >= MESSAGES

        await wait_until(all_stored, timeout=150, message="every message stored after ack_wait")
        await _wait_healthy(process, crash.http_port)
        assert process.terminate() == 0
    finally:
        process.cleanup()
    retried = [r for r in _records(process.log_text()) if r.get("event") == "subscription_unproven"]
    assert retried, "the probe was held back by ack_wait (the case this test is about)"
    assert retried[0]["setting"] == ACL_SETTING, retried[0]
    conn = await asyncpg.connect(db_dsn)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM telemetry")
        seqs = await conn.fetchval("SELECT count(DISTINCT seq) FROM telemetry")
    finally:
        await conn.close()
    assert (rows, seqs) == (MESSAGES, MESSAGES), f"stored {crash.at_kill} at the kill"


async def test_a_command_reaches_a_paho_device_and_its_receipt_closes_it(
    corner: Corner, db_dsn: str
) -> None:
    config = make_config(
        dsn=db_dsn,
        mqtt_port=corner.broker.port,
        node_id=corner.node_id,
        protocol="3.1.1",
        mqtt_extra=corner.mqtt_extra(),
        extra=COMMANDS,
    )
    device = await asyncio.to_thread(PahoDevice, corner.broker.port, corner.topics, "dev-1")
    try:
        async with running_daemon(config) as daemon, _api(daemon.http_port) as api:
            created = await api.call(
                "POST",
                "/devices/dev-1/commands",
                token=OPERATOR,
                json={"name": "open_valve", "params": {"valve": 2}},
            )
            assert created.status == 201, created.body
            command_id = created.body["command"]["id"]

            async def acked() -> bool:
                detail = await api.call("GET", f"/commands/{command_id}", token=OPERATOR)
                return bool(detail.body["command"]["status"] == "ACKED")

            await wait_until(acked, timeout=30, message="the command ACKED by the device")
            detail = await api.call("GET", f"/commands/{command_id}", token=OPERATOR)
            assert detail.body["command"]["result_code"] == 0
            assert [r["outcome"] for r in detail.body["receipts"]] == ["accepted"]
            assert daemon.session is not None
            assert daemon.session.connections == 1
    finally:
        device.close()
    (downlink,) = device.downlinks
    assert downlink["commandId"] == command_id
    assert downlink["name"] == "open_valve"
    assert downlink["params"] == {"valve": 2}
    assert downlink["nodeId"] == corner.node_id


async def _run_until_exit(process: DaemonProcess, http_port: int) -> bool:
    """Start the gateway and wait for it to exit (within 60 s); whether /health ever said 200."""
    healthy_seen = False
    try:
        process.start()

        async def exited() -> bool:
            nonlocal healthy_seen
            healthy_seen = healthy_seen or await http_healthy(http_port)
            return not process.alive()

        await wait_until(exited, timeout=60, interval=0.05, message="the gateway's exit")
    finally:
        process.cleanup()
    return healthy_seen


async def test_shared_group_is_refused_and_never_healthy(
    corner: Corner, db_dsn: str, tmp_path: Path
) -> None:
    """Both brokers grant ``$share/gateways/...`` and deliver nothing to it (checked by hand
    with paho: a subscriber there gets nothing a plain one gets). The gateway must not run
    healthy storing nothing: it exits 2 naming shared_group, and /health never answers 200
    meanwhile."""
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(corner.toml(db_dsn, 'shared_group = "gateways"', http_port=http_port))
    process = DaemonProcess(config, tmp_path / "daemon.log")
    healthy_seen = await _run_until_exit(process, http_port)
    assert not healthy_seen, "healthy while its subscription delivers nothing"
    assert process.exit_code() == EXIT_CONFIG, process.log_tail()
    (line,) = [r for r in _records(process.log_text()) if r.get("event") == "startup_failed"]
    assert line["setting"] == SHARED_SETTING, line
    topic_filter = f"$share/gateways/{corner.prefix}/devices/+/telemetry"
    assert f"'{topic_filter}'" in line["error"], line
    assert "did not deliver the gateway's probe" in line["error"], line
    assert await count_rows(db_dsn) == 0


async def test_an_oversized_downlink_fails_at_once_on_one_connection(
    corner: Corner, db_dsn: str, db: asyncpg.Connection
) -> None:
    """MQTT 3.1.1 cannot say a broker's limit: ``[mqtt] max_packet_size`` is the guard."""
    config = make_config(
        dsn=db_dsn,
        mqtt_port=corner.broker.port,
        node_id=corner.node_id,
        protocol="3.1.1",
        mqtt_extra=corner.mqtt_extra(f"max_packet_size = {LIMIT}"),
        extra=COMMANDS,
    )
    async with running_daemon(config) as daemon:

        async def command(params: dict[str, object]) -> int:
            async with db.transaction():
                created = await new_command(
                    db, device_id="dev-1", name="set", params=params,
                    delivery=Delivery.DEFERRABLE, idempotency_key=None, actor="test",
                    node_id="test", expire_after_s=3600,
                )  # fmt: skip
            return int(created.command.id)

        big = await command({"blob": "x" * (2 * LIMIT)})

        async def status_of(command_id: int, wanted: str) -> bool:
            status = await db.fetchval("SELECT status FROM command WHERE id = $1", command_id)
            return bool(status == wanted)

        await wait_until(lambda: status_of(big, "FAILED"), timeout=30, message="big FAILED")
        row = await db.fetchrow("SELECT * FROM command WHERE id = $1", big)
        assert row["raw_result_code"] == "PACKET_TOO_LARGE"
        assert (row["reclaim_count"], row["retry_count"]) == (0, 0)

        small = await command({"on": True})
        await wait_until(lambda: status_of(small, "SENT"), timeout=30, message="small SENT")
        assert daemon.session is not None
        assert daemon.session.connections == 1


async def _change_prefix(corner: Corner, db_dsn: str, how: str) -> tuple[str, str]:
    """Prefix A, then prefix B (same node, same persistent session) by a restart or by a
    reload; then a device publishes under A and under B. Returns (A, B) once B's message is
    stored."""
    old, new = f"{corner.prefix}a", f"{corner.prefix}b"

    def config(prefix: str) -> Any:
        return make_config(
            dsn=db_dsn,
            mqtt_port=corner.broker.port,
            node_id=corner.node_id,
            protocol="3.1.1",
            mqtt_extra=corner.mqtt_extra(prefix=prefix),
        )

    if how == "restart":
        async with running_daemon(config(old)):
            pass
    async with running_daemon(config(new if how == "restart" else old)) as daemon:
        if how == "reload":
            daemon.reload(config(new))
            session = daemon.session
            assert session is not None
            wanted = tuple(subscriptions(config(new), "3.1.1"))
            await wait_until(
                lambda: session.subscribed and session.subscriptions == wanted,
                message="subscribed again under the new prefix",
            )
        acked = await publish(
            corner.broker.port,
            [(Topics(old).telemetry("dev-1"), SAMPLE), (Topics(new).telemetry("dev-1"), SAMPLE)],
            f"{corner.prefix}-device",
        )
        assert acked == [True, True]
        writer = daemon.writer
        assert writer is not None
        # Published after the old prefix's message, on the same connection, and handled after
        # it: once it is stored the other was handled too.
        await wait_until(lambda: writer.stored_total == 1, message="the new prefix's message")
    return old, new


async def _remembered(db: asyncpg.Connection) -> set[str]:
    return {r[0] for r in await db.fetch("SELECT topic_filter FROM mqtt_subscription")}


@pytest.mark.parametrize("how", ["restart", "reload"])
async def test_a_changed_prefix_leaves_nothing_of_the_old_one(
    nats_broker: Nats, db_dsn: str, db: asyncpg.Connection, how: str
) -> None:
    """What is published under the old prefix reaches the gateway no more: the old filters are
    unsubscribed at connect (``stale_subscriptions_removed``)."""
    _old, new = await _change_prefix(Corner(nats_broker), db_dsn, how)
    assert await db.fetchval("SELECT count(*) FROM dead_letter") == 0
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 1
    kinds = ("telemetry", "acks", "status")
    assert await _remembered(db) == {f"{new}/devices/+/{kind}" for kind in kinds}


@pytest.mark.parametrize("how", ["restart", "reload"])
async def test_rabbitmq_drops_an_earlier_connections_filter_once_made_again(
    rabbit_broker: RabbitMQ, db_dsn: str, db: asyncpg.Connection, how: str
) -> None:
    """RabbitMQ 3.10 answers UNSUBSCRIBE with UNSUBACK and removes nothing when the filter was
    subscribed on an earlier connection of the persistent session (its connection process
    knows only its own subscriptions); on the same connection the unbind works. With
    ``broker_family = "rabbitmq"`` the gateway subscribes a stale filter again before removing
    it: the old prefix's messages reach it no more, and the binding is gone."""
    corner = Corner(rabbit_broker)
    old, new = await _change_prefix(corner, db_dsn, how)
    kinds = ("telemetry", "acks", "status")
    assert await _remembered(db) == {f"{new}/devices/+/{kind}" for kind in kinds}
    assert await db.fetchval("SELECT count(*) FROM dead_letter") == 0
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 1
    listed = await asyncio.to_thread(
        rabbit_broker.ctl, "list_bindings", "destination_name", "routing_key"
    )
    assert listed.returncode == 0, listed.stderr
    queue = f"mqtt-subscription-gateway-{corner.node_id}qos1"
    assert f"{queue}\t{old}.devices.*.telemetry" not in listed.stdout, listed.stdout


def _restricted() -> tuple[str, str]:
    return f'username = "{RESTRICTED_USER}"', f'password = "{RESTRICTED_PASSWORD}"'


async def test_nats_refuses_the_subscription_and_the_gateway_names_the_acl(
    nats_broker: Nats, db_dsn: str, tmp_path: Path
) -> None:
    """NATS answers a subscription its permissions deny with SUBACK 0x80: exit 2 at start."""
    corner = Corner(nats_broker)
    config = tmp_path / "gateway.toml"
    config.write_text(corner.toml(db_dsn, *_restricted()))
    done = await gateway_run(config)
    assert done.returncode == EXIT_CONFIG, done.output
    done.assert_no_traceback()
    line = done.the("startup_failed")
    assert line["setting"] == ACL_SETTING, line
    assert f"refused the subscription '{corner.prefix}/devices/+/telemetry'" in line["error"]
    assert line["error"].endswith("(reason code 128)"), line


async def test_rabbitmq_closes_the_connection_on_a_refused_subscription(
    rabbit_broker: RabbitMQ, db_dsn: str, tmp_path: Path
) -> None:
    """RabbitMQ 3.10 answers a subscription its topic permissions deny by closing the
    connection ("access_refused" in its log), not with SUBACK 0x80. The gateway used to take
    it for a lost connection and reconnect in a loop naming the wrong setting ("[mqtt] host,
    [mqtt] port", then a client-id takeover). Two connections in a row lost while subscribing
    now name the subscription and the ACL: exit 2 at start, never healthy, nothing stored."""
    corner = Corner(rabbit_broker)
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(corner.toml(db_dsn, *_restricted(), http_port=http_port))
    process = DaemonProcess(config, tmp_path / "daemon.log")
    healthy_seen = await _run_until_exit(process, http_port)
    assert not healthy_seen, "healthy while RabbitMQ refuses its subscription"
    assert process.exit_code() == EXIT_CONFIG, process.log_tail()
    (line,) = [r for r in _records(process.log_text()) if r.get("event") == "startup_failed"]
    assert "closed the connection each time the gateway subscribed" in line["error"], line
    assert "ACL" in line["setting"], line
    assert await count_rows(db_dsn) == 0


async def test_a_witness_tells_rabbitmq_s_denial_from_a_granted_subscription(
    rabbit_broker: RabbitMQ,
) -> None:
    """What the gateway asks after two connections lost while subscribing (a denial, or another
    client taking its client id over): a witness under another client id subscribes and
    probes. RabbitMQ closes the restricted user's witness (True), lets the unrestricted one do
    it all (False); a broker the witness cannot reach tells nothing (None)."""
    corner = Corner(rabbit_broker)
    filters = [f"{corner.prefix}/devices/+/telemetry"]
    probe = (f"{corner.prefix}/devices/{PROBE_DEVICE}/telemetry", PROBE_MARK + b"witness-test")
    granted = ConnectionSettings(
        host="127.0.0.1", port=rabbit_broker.port, client_id=corner.node_id, protocol="3.1.1"
    )
    denied = dataclasses.replace(granted, username=RESTRICTED_USER, password=RESTRICTED_PASSWORD)
    assert await closes_subscribing(denied, filters, probe) is True
    assert await closes_subscribing(denied, filters, None) is True
    assert await closes_subscribing(granted, filters, probe) is False
    unreachable = dataclasses.replace(granted, port=free_port(), timeout_s=2)
    assert await closes_subscribing(unreachable, filters, probe) is None


async def test_device_ids_with_a_dot_are_refused_at_the_api(corner: Corner, db_dsn: str) -> None:
    config = make_config(
        dsn=db_dsn,
        mqtt_port=corner.broker.port,
        node_id=corner.node_id,
        protocol="3.1.1",
        mqtt_extra=corner.mqtt_extra(),
        extra=COMMANDS,
    )
    async with running_daemon(config) as daemon, _api(daemon.http_port) as api:
        refused = await api.call(
            "POST", "/devices/dev.1/commands", token=OPERATOR, json={"name": "set"}
        )
        assert refused.status == 400, refused.body
        assert refused.body["error"] == "BAD_DEVICE_ID"
        assert refused.body["device_id"] == "dev.1"
        assert await _scalar(db_dsn, "SELECT count(*) FROM command") == 0


async def test_rabbitmq_maps_a_dotted_device_topic_out_of_the_gateways_reach(
    rabbit_broker: RabbitMQ, db_dsn: str, db: asyncpg.Connection
) -> None:
    """FINDING (as issue 28 reported): RabbitMQ turns the `.` of ``p/devices/dev.1/telemetry``
    into a level separator (``p/devices/dev/1/telemetry``), which no filter of the gateway
    matches: PUBACKed to the device, neither stored nor dead-lettered. The gateway cannot see
    it; ``broker_family`` only keeps the gateway's own side (API, downlinks) from using such
    ids. Checked here: a paho subscriber to ``p/#`` receives the mapped topic."""
    corner = Corner(rabbit_broker)
    config = make_config(
        dsn=db_dsn,
        mqtt_port=corner.broker.port,
        node_id=corner.node_id,
        protocol="3.1.1",
        mqtt_extra=corner.mqtt_extra(),
    )
    dotted = f"{corner.prefix}/devices/dev.1/telemetry"
    seen: list[str] = []
    watcher = await asyncio.to_thread(_paho, corner.broker.port, f"{corner.prefix}-watch")
    subscribed = threading.Event()
    watcher.on_subscribe = lambda *_: subscribed.set()
    watcher.on_message = lambda _c, _u, message: seen.append(message.topic)
    watcher.subscribe(f"{corner.prefix}/#", qos=1)
    try:
        assert await asyncio.to_thread(subscribed.wait, 10)
        async with running_daemon(config) as daemon:
            acked = await publish(
                corner.broker.port,
                [(dotted, SAMPLE), (corner.topics.telemetry("dev-1"), SAMPLE)],
                f"{corner.prefix}-device",
            )
            assert acked == [True, True]  # RabbitMQ accepted both
            writer = daemon.writer
            assert writer is not None
            await wait_until(lambda: writer.stored_total == 1, message="dev-1's message")
            await wait_until(
                lambda: f"{corner.prefix}/devices/dev/1/telemetry" in seen,
                message=f"the mapped topic at the watcher (saw {seen})",
            )
    finally:
        watcher.disconnect()
        watcher.loop_stop()
    assert dotted not in seen
    assert await db.fetchval("SELECT count(*) FROM dead_letter") == 0
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 1


async def test_nats_closes_a_device_connection_publishing_a_dotted_topic(
    nats_broker: Nats, db_dsn: str, db: asyncpg.Connection
) -> None:
    """NATS refuses a `.` in an MQTT topic by closing the publisher's connection: the device
    knows (its publish is never acknowledged); the gateway's own connection is untouched."""
    corner = Corner(nats_broker)
    config = make_config(
        dsn=db_dsn,
        mqtt_port=corner.broker.port,
        node_id=corner.node_id,
        protocol="3.1.1",
        mqtt_extra=corner.mqtt_extra(),
    )
    async with running_daemon(config) as daemon:
        dotted = f"{corner.prefix}/devices/dev.1/telemetry"
        assert await publish(corner.broker.port, [(dotted, SAMPLE)], "dotted-device") == [False]
        good = [(corner.topics.telemetry("dev-1"), SAMPLE)]
        assert await publish(corner.broker.port, good, f"{corner.prefix}-device") == [True]
        writer = daemon.writer
        assert writer is not None
        await wait_until(lambda: writer.stored_total == 1, message="dev-1's message")
        assert daemon.session is not None
        assert daemon.session.connections == 1
    assert await db.fetchval("SELECT count(*) FROM dead_letter") == 0
