"""[[ingest.mappings]] end to end: a real daemon, real mosquitto, real PostgreSQL, and a
device client publishing Tasmota's documented payloads on Tasmota's own topics (issue 25 §2).

The mapped messages take the native path unchanged from there: stored once however often
redelivered (event ids), PUBACK after the commit, rules raising alarms on mapped metrics,
presence from the LWT feeding the inactivity rules, dead letters keeping the raw bytes; a
command to a mapped device goes out on the mapping's topic; a reload adding a mapping
subscribes its topics at once.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

import aiohttp
import aiomqtt
import asyncpg
import pytest

from gateway.config import parse_config
from gateway.runtime.components import subscriptions
from gateway.runtime.daemon import Daemon
from sim.publisher import publish_many
from sim.telemetry import device_ids
from sim.vendor import vendor_stream
from tests.support.api_client import ADMIN, OPERATOR, ApiClient
from tests.support.daemon import (
    DaemonProcess,
    config_toml,
    count_rows,
    http_healthy,
    make_config,
    metric,
    running_daemon,
)
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

FIXTURES: Final = Path(__file__).resolve().parents[2] / "fixtures" / "mappings"
SENSOR: Final = (FIXTURES / "tasmota-am2301-sensor.json").read_bytes()
API: Final = f'[[api.tokens]]\ntoken = "{OPERATOR}"\nrole = "operator"\nname = "ops"\n'
TASMOTA: Final = '[[ingest.mappings]]\nname = "tasmota"\nprofile = "tasmota"\n'
RULES: Final = """
[[rules]]
key = "hot"
kind = "threshold"
metric = "AM2301.Temperature"
op = ">"
value = 30
severity = "CRITICAL"

[[rules]]
key = "misspelled"
kind = "threshold"
metric = "AM2301.Temperatur"
op = ">"
value = 30
severity = "WARNING"

[[rules]]
key = "gone"
kind = "inactivity"
silent_seconds = 3600
severity = "WARNING"
"""


def _reading(temperature: float, at: str) -> bytes:
    return SENSOR.replace(b"24.6", str(temperature).encode()).replace(
        b"2019-01-01T00:00:00", at.encode()
    )


async def _publish(port: int, messages: list[tuple[str, bytes, bool]]) -> None:
    async with aiomqtt.Client("127.0.0.1", port, identifier="tasmota-kitchen") as device:
        for topic, payload, retain in messages:
            await device.publish(topic, payload, qos=1, retain=retain)


async def _count(db: asyncpg.Connection, sql: str, *args: object) -> int:
    return int(await db.fetchval(sql, *args))


async def test_tasmota_device_end_to_end(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    toml = config_toml(
        dsn=db_dsn,
        mqtt_port=mosquitto.port,
        extra=API + RULES + TASMOTA + "[commands]\nack_window_s = 0.2\n",
    )
    config = parse_config(toml)
    async with running_daemon(config) as daemon:
        port = mosquitto.port
        # Tasmota's Time, as a device set to UTC prints it: within the `rules check` window.
        now = datetime.now(UTC).replace(microsecond=0, tzinfo=None)
        hot = _reading(35.5, (now - timedelta(seconds=60)).isoformat())
        # The same reading three times (a device retrying, a broker redelivering), then a
        # cooler one, then a payload nobody can read.
        await _publish(
            port,
            [
                ("tele/kitchen/SENSOR", hot, False),
                ("tele/kitchen/SENSOR", hot, False),
                ("tele/kitchen/SENSOR", hot, False),
                (
                    "tele/kitchen/SENSOR",
                    _reading(21.0, (now - timedelta(seconds=30)).isoformat()),
                    False,
                ),
                ("tele/kitchen/SENSOR", b'{"AM2301": {"Temperature": ', False),
            ],
        )

        async def settled() -> bool:
            letters = await _count(db, "SELECT count(*) FROM dead_letter")
            stored = await _count(db, "SELECT count(*) FROM telemetry")
            return letters == 1 and stored == 2

        await wait_until(settled, timeout=30, message="two readings and one dead letter")
        # Redeliveries come one by one too: after the commit of the first, each is known.
        await _publish(port, [("tele/kitchen/SENSOR", hot, False)])
        await _publish(port, [("tele/kitchen/SENSOR", b"{}", False)])
        await wait_until(settled_after_redelivery(db), timeout=30, message="one more letter")
        assert await _count(db, "SELECT count(*) FROM telemetry") == 2
        rows = await db.fetch(
            "SELECT device_id, metrics::text AS metrics FROM telemetry ORDER BY metrics::text"
        )
        assert [(r["device_id"], r["metrics"]) for r in rows] == [
            ("kitchen", '{"AM2301.Humidity": 58.2, "AM2301.Temperature": 21.0}'),
            ("kitchen", '{"AM2301.Humidity": 58.2, "AM2301.Temperature": 35.5}'),
        ]
        letter = await db.fetchrow("SELECT topic, payload, reason, detail FROM dead_letter")
        assert letter["topic"] == "tele/kitchen/SENSOR"
        assert bytes(letter["payload"]) == b'{"AM2301": {"Temperature": '
        assert letter["reason"] == "MAPPING_MALFORMED"
        assert letter["detail"].startswith("mapping 'tasmota': not JSON")
        # The rule on the mapped metric fired once (the redeliveries raised nothing more).
        alarms = await db.fetch("SELECT device_id, rule_key FROM alarm WHERE rule_key = 'hot'")
        assert [(a["device_id"], a["rule_key"]) for a in alarms] == [("kitchen", "hot")]
        assert (
            await db.fetchval(
                "SELECT mapping || ' ' || captures::text FROM device_mapping"
                " WHERE device_id = 'kitchen'"
            )
            == 'tasmota {"device": "kitchen"}'
        )

        # The LWT (retained, as Tasmota publishes it): presence offline, an inactivity alarm.
        await _publish(port, [("tele/kitchen/LWT", b"Offline", True)])

        async def offline() -> bool:
            return bool(
                await db.fetchval("SELECT presence FROM device WHERE device_id = 'kitchen'")
                == "offline"
            )

        await wait_until(offline, timeout=30, message="kitchen offline")
        assert daemon.components is not None
        raised = await daemon.components.inactivity.run_once()
        assert len(raised) == 1
        assert await db.fetchval("SELECT rule_key FROM alarm WHERE id = $1", raised[0]) == "gone"

        # A command to the mapped device: Tasmota's own command topic, the template's payload.
        async with aiomqtt.Client("127.0.0.1", port, identifier="tasmota-listener") as listener:
            await listener.subscribe("cmnd/kitchen/#", qos=1)
            async with aiohttp.ClientSession() as http:
                api = ApiClient(base=f"http://127.0.0.1:{daemon.http_port}", http=http)
                reply = await api.call(
                    "POST",
                    "/devices/kitchen/commands",
                    token=OPERATOR,
                    json={"name": "POWER", "params": {"value": "ON"}},
                )
                assert reply.status == 201, reply.body
                command_id = reply.body["command"]["id"]
            async with asyncio.timeout(30):
                message = await anext(aiter(listener.messages))
            assert message.topic.value == "cmnd/kitchen/POWER"
            assert message.payload == b"ON"

        async def sent() -> bool:
            status = await db.fetchval("SELECT status FROM command WHERE id = $1", command_id)
            return bool(status == "SENT")

        await wait_until(sent, timeout=30, message="the command SENT")

        # No receipt will ever come from a vendor device: the ack window does not turn its
        # command into a TIMEOUT (nor publish a deferrable one again and again).
        async def window_passed() -> bool:
            return bool(
                await db.fetchval(
                    "SELECT sent_at < now() - interval '0.5 s' FROM command WHERE id = $1",
                    command_id,
                )
            )

        await wait_until(window_passed, timeout=30, message="past the ack window")
        await daemon.components.reaper.run_once()
        assert await db.fetchval("SELECT status FROM command WHERE id = $1", command_id) == "SENT"

    # `gateway rules check` sees the mapped metric names as any others: the misspelled rule
    # is named with the mapped name closest to it, the right one is not.
    path = tmp_path / "gateway.toml"
    path.write_text(toml)
    check = _gateway("rules", "check", "--config", str(path), "--since", "2h")
    assert check.returncode == 1, check.stderr
    lines = check.stdout.splitlines()
    assert any(
        "'misspelled'" in line and "closest seen: AM2301.Temperature" in line for line in lines
    ), check.stdout
    assert not any("'hot'" in line for line in lines)


def test_check_config_names_a_mapping_mistake_by_its_key_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        '[[ingest.mappings]]\nname = "t"\nprofile = "tasmota"\ntimezone = "Mars/Olympus"\n'
        '[[ingest.mappings]]\nname = "c"\ntopic = "iot/devices/{device}/telemetry"\n'
        'flatten = "$"\n'
    )
    result = _gateway("check-config", str(path))
    assert result.returncode == 2
    assert "ingest.mappings[0].timezone: unknown time zone 'Mars/Olympus'" in result.stderr
    good = tmp_path / "good.toml"
    good.write_text('[[ingest.mappings]]\nname = "t"\nprofile = "tasmota"\n')
    assert _gateway("check-config", str(good)).returncode == 0


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def settled_after_redelivery(db: asyncpg.Connection) -> Callable[[], Awaitable[bool]]:
    async def done() -> bool:
        # The `{}` after the redelivery: once it is a dead letter, the redelivery (read
        # before it) is settled too.
        return await _count(db, "SELECT count(*) FROM dead_letter") == 2

    return done


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_reload_adding_a_mapping_subscribes_its_topics_and_ingests_them(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, protocol: str
) -> None:
    """On 3.1.1 the new filters are proven by the probe, as the native ones are."""
    port = mosquitto.port
    before = make_config(dsn=db_dsn, mqtt_port=port, protocol=protocol)
    after = make_config(
        dsn=db_dsn,
        mqtt_port=port,
        protocol=protocol,
        extra='[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n',
    )
    async with running_daemon(before) as daemon:
        session = daemon.session
        assert session is not None
        assert "zigbee2mqtt/+" not in session.subscriptions
        daemon.reload(after)
        wanted = tuple(subscriptions(after, session.settings.protocol))
        assert "zigbee2mqtt/+" in wanted
        assert "zigbee2mqtt/+/availability" in wanted
        await wait_until(
            lambda: session.subscribed and session.subscriptions == wanted,
            timeout=30,
            message="subscribed to the mapping's topics",
        )
        payload = (FIXTURES / "zigbee2mqtt-wsdcgq01lm.json").read_bytes()
        await _publish(port, [("zigbee2mqtt/0x00158d0001d8e1d2", payload, False)])

        async def stored() -> bool:
            return await _count(db, "SELECT count(*) FROM telemetry") == 1

        await wait_until(stored, timeout=30, message="the mapped reading stored")
        row = await db.fetchrow("SELECT device_id, metrics::text AS metrics FROM telemetry")
        assert row["device_id"] == "0x00158d0001d8e1d2"
        assert row["metrics"] == '{"humidity": 44.72, "temperature": 27.34}'

        # The same topics, another reading of them: swapped between batches, no reconnect.
        connections = session.connections
        daemon.reload(
            make_config(
                dsn=db_dsn,
                mqtt_port=port,
                protocol=protocol,
                extra='[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n'
                'exclude = ["humidity"]\n',
            )
        )
        await _publish(
            port,
            [("zigbee2mqtt/0x00158d0001d8e1d2", b'{"temperature": 30.5, "humidity": 50}', False)],
        )

        async def second() -> bool:
            return await _count(db, "SELECT count(*) FROM telemetry") == 2

        await wait_until(second, timeout=30, message="the second reading stored")
        assert (
            await db.fetchval(
                "SELECT metrics::text FROM telemetry WHERE metrics ? 'temperature'"
                " AND (metrics->>'temperature')::float = 30.5"
            )
            == '{"temperature": 30.5}'
        )
        assert session.connections == connections


async def test_a_device_whose_mapping_a_reload_removed_gets_the_ack_window_again(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """A Tasmota device reflashed to speak the native protocol: its mapping is removed from
    the file and the daemon reloaded. Its commands go out natively again, and one the device
    does not answer is judged by the ack window (FAILED, realtime), not left SENT for a day as
    a vendor device's."""
    port = mosquitto.port
    commands = "[commands]\nack_window_s = 0.2\nreaper_interval_s = 3600\n"
    before = parse_config(config_toml(dsn=db_dsn, mqtt_port=port, extra=API + TASMOTA + commands))
    after = parse_config(config_toml(dsn=db_dsn, mqtt_port=port, extra=API + commands))
    async with running_daemon(before) as daemon:
        now = datetime.now(UTC).replace(microsecond=0, tzinfo=None)
        await _publish(port, [("tele/kitchen/SENSOR", _reading(24.6, now.isoformat()), False)])

        async def recorded() -> bool:
            sql = "SELECT count(*) FROM device_mapping WHERE device_id = 'kitchen'"
            return await _count(db, sql) == 1

        await wait_until(recorded, timeout=30, message="kitchen recorded as mapped")
        daemon.reload(after)
        async with aiomqtt.Client("127.0.0.1", port, identifier="kitchen-native") as device:
            await device.subscribe("iot/devices/kitchen/commands", qos=1)
            async with aiohttp.ClientSession() as http:
                api = ApiClient(base=f"http://127.0.0.1:{daemon.http_port}", http=http)
                reply = await api.call(
                    "POST", "/devices/kitchen/commands", token=OPERATOR,
                    json={"name": "reboot", "params": {}, "delivery": "realtime"},
                )  # fmt: skip
                assert reply.status == 201, reply.body
                command_id = reply.body["command"]["id"]
            async with asyncio.timeout(30):
                message = await anext(aiter(device.messages))
            assert message.topic.value == "iot/devices/kitchen/commands"  # native again
        assert daemon.components is not None
        reaper = daemon.components.reaper

        async def failed() -> bool:
            await reaper.run_once()
            sql = "SELECT status FROM command WHERE id = $1"
            return bool(await db.fetchval(sql, command_id) == "FAILED")

        await wait_until(failed, timeout=30, message="the unanswered command FAILED")
        result = await db.fetchval("SELECT result FROM command WHERE id = $1", command_id)
        assert result == "TIMEOUT"


async def test_gateway_sim_publishes_each_vendor_format_and_every_reading_is_stored_once(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """`gateway-sim publish --format` against a daemon with the four profiles: every message
    stored once, no dead letter. Published again (`--fixed-time`: the same readings), those
    that carry their time are the same rows; Zigbee2MQTT's, which carry none, are new
    readings in a later receive window (docs/devices.md#event-ids-and-redelivery)."""
    profiles = ("tasmota", "zigbee2mqtt", "shelly-gen2", "chirpstack-v4")
    extra = "".join(f'[[ingest.mappings]]\nname = "{p}"\nprofile = "{p}"\n' for p in profiles)
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=extra)
    per_format = 300

    async def publish(fmt: str) -> None:
        published = await asyncio.to_thread(
            subprocess.run,
            [
                *(sys.executable, "-m", "sim", "publish", "--format", fmt, "--fixed-time"),
                *("--host", "127.0.0.1", "--port", str(mosquitto.port)),
                *("--devices", "6", "--messages", str(per_format)),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert published.returncode == 0, published.stderr
        assert f"published {per_format} messages ({fmt}) from 6 devices" in published.stdout

    async def stored(count: int) -> None:
        async def done() -> bool:
            return await _count(db, "SELECT count(*) FROM telemetry") == count

        await wait_until(done, timeout=60, message=f"{count} readings stored")

    async with running_daemon(config):
        for fmt in profiles:
            await publish(fmt)
        await stored(4 * per_format)
        for fmt in ("tasmota", "shelly-gen2", "chirpstack-v4"):
            await publish(fmt)
        # The z2m readings published once more: a later window, new rows (as documented);
        # wait for them, so that the repeats above are known to be read by then too.
        await publish("zigbee2mqtt")
        await stored(5 * per_format)
        assert await _count(db, "SELECT count(*) FROM dead_letter") == 0
        # gateway-sim names devices pub-00000...; ChirpStack's are their DevEUIs.
        assert await _count(db, "SELECT count(*) FROM device_mapping") == 12


async def test_two_nodes_in_a_shared_group_store_each_mapped_reading_once(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """Mapped telemetry is subscribed with the shared group (each message reaches one node),
    mapped presence without it (retained: both nodes apply it, harmlessly)."""
    configs = [
        make_config(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            node_id=node,
            mqtt_extra='shared_group = "gateways"',
            extra=TASMOTA,
        )
        for node in ("node-0", "node-1")
    ]
    assert "$share/gateways/tele/+/SENSOR" in subscriptions(configs[0], "5")
    assert "tele/+/LWT" in subscriptions(configs[0], "5")
    count = 400
    now = datetime.now(UTC).replace(microsecond=0, tzinfo=None)
    readings = [
        (
            f"tele/plug-{n % 8}/SENSOR",
            _reading(20 + n % 10, (now - timedelta(seconds=count - n)).isoformat()),
            False,
        )
        for n in range(count)
    ]
    async with running_daemon(configs[0]) as first, running_daemon(configs[1]) as second:
        await _publish(mosquitto.port, [*readings, ("tele/plug-0/LWT", b"Online", True)])

        async def stored() -> bool:
            return await _count(db, "SELECT count(*) FROM telemetry") == count

        await wait_until(stored, timeout=60, message="every reading stored")

        def received(daemon: Daemon) -> float:
            return metric(daemon, "gateway_telemetry_received_total")

        # Shared: between them the nodes received each reading once (none twice).
        await wait_until(
            lambda: received(first) + received(second) == count,
            timeout=30,
            message="each reading received by one node",
        )
        assert received(first) > 0
        assert received(second) > 0

        async def online() -> bool:
            return bool(
                await db.fetchval("SELECT presence FROM device WHERE device_id = 'plug-0'")
                == "online"
            )

        await wait_until(online, timeout=30, message="plug-0 online")


async def test_a_dead_letter_of_a_mapping_is_replayed_once_the_mapping_is_fixed(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """A boiler's naive ISO time, and no timezone yet: MAPPING_BAD_TIMESTAMP with the raw
    bytes. The reload that names the zone reaches the replay path too: replayed, stored."""
    mapping = (
        '[[ingest.mappings]]\nname = "boilers"\ntopic = "plant/{device}/state"\n'
        'timestamp_path = "$.at"\nflatten = "$"\nexclude = ["at"]\n'
    )
    admin = f'[[api.tokens]]\ntoken = "{ADMIN}"\nrole = "admin"\nname = "root"\n'
    port = mosquitto.port
    payload = b'{"at": "2026-01-01T12:00:00", "temp": 71.5}'
    config = make_config(dsn=db_dsn, mqtt_port=port, extra=admin + mapping)
    async with running_daemon(config) as daemon:
        await _publish(port, [("plant/b-1/state", payload, False)])

        async def lettered() -> bool:
            return await _count(db, "SELECT count(*) FROM dead_letter") == 1

        await wait_until(lettered, timeout=30, message="the dead letter")
        letter = await db.fetchrow("SELECT id, reason, payload FROM dead_letter")
        assert letter["reason"] == "MAPPING_BAD_TIMESTAMP"
        assert bytes(letter["payload"]) == payload

        daemon.reload(
            make_config(
                dsn=db_dsn,
                mqtt_port=port,
                extra=admin + mapping + 'timezone = "Europe/Berlin"\n',
            )
        )
        async with aiohttp.ClientSession() as http:
            api = ApiClient(base=f"http://127.0.0.1:{daemon.http_port}", http=http)
            reply = await api.call("POST", f"/dead-letters/{letter['id']}/replay", token=ADMIN)
        assert reply.status == 200, reply.body
        assert reply.body["outcome"] == "stored"
        row = await db.fetchrow("SELECT device_id, ts, metrics::text AS metrics FROM telemetry")
        assert row["device_id"] == "b-1"
        assert row["ts"] == datetime(2026, 1, 1, 11, 0, tzinfo=UTC)  # 12:00 in Berlin
        assert row["metrics"] == '{"temp": 71.5}'


async def test_sigkill_mid_stream_of_mapped_messages_then_restart_loses_none(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """As the native SIGKILL test (test_process.py), on Tasmota traffic: the kill lands while
    a batch of mapped messages waits on a lock inside its transaction (received, not
    committed, not acknowledged); after the restart the broker redelivers them and every
    reading is stored, once."""
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            node_id="crash-node",
            http_port=http_port,
            ingest_extra="batch_max = 20\nlinger_ms = 0",
            extra=TASMOTA,
        )
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    stream = list(vendor_stream("tasmota", device_ids(50), 3000))
    blocker = await asyncpg.connect(db_dsn)

    async def healthy() -> bool:
        assert process.alive(), f"daemon exited:\n{process.log_tail()}"
        return await http_healthy(http_port)

    try:
        process.start()
        await wait_until(healthy, timeout=60, message="daemon healthy")
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=500) as pub:
            await publish_many(pub, stream[:1000], window=500)

            async def first_stored() -> bool:
                return await count_rows(db_dsn) >= 1000

            await wait_until(first_stored, timeout=60, message="the first 1,000 stored")
            blocker_tx = blocker.transaction()
            await blocker_tx.start()
            await blocker.execute("LOCK TABLE telemetry IN EXCLUSIVE MODE")
            await publish_many(pub, stream[1000:], window=500)

        async def writer_blocked() -> bool:
            waiting = await blocker.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            return bool(waiting)

        await wait_until(writer_blocked, timeout=60, message="a batch waiting on the lock")
        process.kill()
        at_kill = await count_rows(db_dsn)
        await blocker_tx.rollback()
        assert at_kill == 1000, "the kill lands with the second part received, none committed"

        process.start()
        await wait_until(healthy, timeout=60, message="daemon healthy again")

        async def all_stored() -> bool:
            return await count_rows(db_dsn) >= 3000

        await wait_until(all_stored, timeout=90, message="every reading stored after restart")
        assert process.terminate() == 0
    finally:
        await blocker.close()
        process.cleanup()
    assert await count_rows(db_dsn) == 3000
    assert await count_rows(db_dsn, "dead_letter") == 0
