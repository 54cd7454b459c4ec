"""Device ids on brokers that map `.` (RabbitMQ, NATS; issue 28, part 5), with the setting that
says so, `[mqtt] broker_family`: an id holding a `.` is refused where it enters, never lost.

The broker here is mosquitto (it carries `.` unchanged): what is tested is the gateway's side,
which must refuse such ids whatever the broker would have done with them.
"""

from __future__ import annotations

import aiohttp
import aiomqtt
import asyncpg
import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.daemon import config_toml, make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

FAMILY = 'broker_family = "rabbitmq"'
EXTRA = (
    f'[[api.tokens]]\ntoken = "{OPERATOR}"\nrole = "operator"\nname = "ops"\n'
    "[commands]\nlease_s = 2\nack_window_s = 0\nreaper_interval_s = 0.2\n"
)
SAMPLE = b'{"ts": 1767225600000, "metrics": {"t": 1.5}}'


async def test_ids_with_a_dot_are_refused_at_every_entry(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, mqtt_extra=FAMILY, extra=EXTRA)
    # A command stored before the setting was made (ids with `.` are valid on mosquitto).
    stranded = await db.fetchval(
        "INSERT INTO command (device_id, name) VALUES ('dev.old', 'set') RETURNING id"
    )
    async with running_daemon(config) as daemon, aiohttp.ClientSession() as http:
        # From a topic: a dead letter with its reason, the rest stored.
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="device") as device:
            await device.publish("iot/devices/dev.1/telemetry", SAMPLE, qos=1)
            await device.publish("iot/devices/dev-1/telemetry", SAMPLE, qos=1)

        async def arrived() -> bool:
            dead = await db.fetchval("SELECT count(*) FROM dead_letter")
            stored = await db.fetchval("SELECT count(*) FROM telemetry")
            return bool(dead == 1 and stored == 1)

        await wait_until(arrived, timeout=30, message="one stored, one dead-lettered")
        letter = await db.fetchrow("SELECT topic, reason, detail FROM dead_letter")
        assert letter["reason"] == "BAD_DEVICE_ID"
        assert "broker_family" in letter["detail"]

        # From the API: 400 BAD_DEVICE_ID, nothing created.
        api = ApiClient(base=f"http://127.0.0.1:{daemon.http_port}", http=http)
        refused = await api.call(
            "POST", "/devices/dev.1/commands", token=OPERATOR, json={"name": "set"}
        )
        assert refused.status == 400, refused.body
        assert refused.body["error"] == "BAD_DEVICE_ID"
        assert refused.body["device_id"] == "dev.1"
        assert await db.fetchval("SELECT count(*) FROM command WHERE device_id = 'dev.1'") == 0

        # Stored before: failed at once with the reason, never published.
        async def failed() -> bool:
            status = await db.fetchval("SELECT status FROM command WHERE id = $1", stranded)
            return bool(status == "FAILED")

        await wait_until(failed, timeout=30, message="the stranded command FAILED")
        row = await db.fetchrow("SELECT * FROM command WHERE id = $1", stranded)
        assert row["raw_result_code"] == "BAD_DEVICE_ID"
        assert daemon.session is not None
        assert daemon.session.connections == 1


def test_a_node_id_with_a_dot_is_a_configuration_error_there() -> None:
    text = config_toml(dsn="postgresql://x/y", mqtt_port=1883, node_id="gw.1", mqtt_extra=FAMILY)
    with pytest.raises(ConfigError, match=r"node\.id.*broker_family"):
        parse_config(text)
    assert parse_config(text.replace(FAMILY, "")).node_id == "gw.1"
