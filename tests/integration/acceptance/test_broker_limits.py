"""The broker's limits, against a real mosquitto that has them (issue 28, part 3).

A downlink over the broker's limit fails its command at once with its reason; the command's
completion event, which carries the same params, is over the limit too and becomes DEAD instead
of being retried forever; and neither drops the connection: the session connects once. Before,
mosquitto's 0x95 PUBACK was taken for a malformed packet: 6 reconnects in 150 s for such a
command (never failed), 8 in 90 s for such an event (retried forever).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from gateway.domain.command import Delivery
from gateway.runtime.daemon import Daemon
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.commands import new_command
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

LIMIT = 4096
COMMANDS = "[commands]\nlease_s = 2\nack_window_s = 0\nreaper_interval_s = 0.2\n"
TOKENS = f'[[api.tokens]]\ntoken = "{OPERATOR}"\nrole = "operator"\nname = "ops"\n'


@pytest.fixture(
    params=[
        # mosquitto refuses with a PUBACK of 0x95, announcing nothing: the gateway learns it then.
        pytest.param(("5", f"message_size_limit {LIMIT}", ""), id="v5-message_size_limit"),
        # mosquitto announces its Maximum Packet Size in CONNACK: refused before sending.
        pytest.param(("5", f"max_packet_size {LIMIT}", ""), id="v5-connack"),
        # 3.1.1 cannot say why it refuses (mosquitto drops the message and acknowledges it):
        # only the configured bound keeps the gateway from losing such a command silently.
        pytest.param(
            ("3.1.1", f"message_size_limit {LIMIT}", f"max_packet_size = {LIMIT}"),
            id="v311-configured",
        ),
    ]
)
def limited(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Mosquitto, str, str]]:
    protocol, broker_line, mqtt_line = request.param
    broker = Mosquitto(tmp_path / "mosquitto", extra_config=f"{broker_line}\n")
    broker.start()
    try:
        yield broker, protocol, mqtt_line
    finally:
        broker.stop()


async def _command(db: asyncpg.Connection, params: dict[str, object]) -> int:
    async with db.transaction():
        created = await new_command(
            db, device_id="dev-1", name="set", params=params, delivery=Delivery.DEFERRABLE,
            idempotency_key=None, actor="test", node_id="test", expire_after_s=3600,
        )  # fmt: skip
    return int(created.command.id)


def _connections(daemon: Daemon) -> int:
    assert daemon.session is not None
    return daemon.session.connections


async def test_an_oversized_downlink_fails_its_command_and_its_event_is_dead_without_reconnects(
    db_dsn: str, db: asyncpg.Connection, limited: tuple[Mosquitto, str, str]
) -> None:
    broker, protocol, mqtt_line = limited
    config = make_config(
        dsn=db_dsn, mqtt_port=broker.port, protocol=protocol, mqtt_extra=mqtt_line, extra=COMMANDS
    )
    async with running_daemon(config) as daemon:
        # Deferrable: a device-side failure would be retried; this one must not be.
        big = await _command(db, {"blob": "x" * (2 * LIMIT)})

        async def failed() -> bool:
            return await db.fetchval("SELECT status FROM command WHERE id = $1", big) == "FAILED"

        await wait_until(failed, timeout=30, message="the oversized command FAILED")
        row = await db.fetchrow("SELECT * FROM command WHERE id = $1", big)
        assert row["raw_result_code"] == "PACKET_TOO_LARGE"
        assert "maximum packet size" in row["raw_ack"]
        assert row["reclaim_count"] == 0
        assert row["retry_count"] == 0
        audit = await db.fetch(
            "SELECT action, note FROM command_audit WHERE command_id = $1 ORDER BY id", big
        )
        assert [a["action"] for a in audit] == ["create", "claim", "unsendable"]
        assert audit[-1]["note"].startswith("PACKET_TOO_LARGE: ")

        # Its command.finished event carries the same params: too large as well, and DEAD.
        async def dead() -> bool:
            status = await db.fetchval(
                "SELECT status FROM outbox_event WHERE aggregate_type = 'command'"
                " AND aggregate_id = $1 AND event_type = 'command.finished'",
                str(big),
            )
            return bool(status == "DEAD")

        await wait_until(dead, timeout=30, message="the oversized event DEAD")
        event = await db.fetchrow(
            "SELECT retry_count, last_error, published_at FROM outbox_event"
            " WHERE aggregate_id = $1 AND event_type = 'command.finished'",
            str(big),
        )
        assert event["retry_count"] == 0
        assert event["published_at"] is None
        assert event["last_error"].startswith("PACKET_TOO_LARGE: ")

        # What fits still goes out, on the same connection.
        small = await _command(db, {"on": True})

        async def sent() -> bool:
            return await db.fetchval("SELECT status FROM command WHERE id = $1", small) == "SENT"

        await wait_until(sent, timeout=30, message="the small command SENT")
        assert _connections(daemon) == 1
        assert daemon.session is not None
        assert daemon.session.connected


async def test_the_api_refuses_params_that_cannot_fit_the_configured_limit(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    config = make_config(
        dsn=db_dsn,
        mqtt_port=mosquitto.port,
        mqtt_extra=f"max_packet_size = {LIMIT}",
        extra=TOKENS,
    )
    async with running_daemon(config) as daemon, aiohttp.ClientSession() as http:
        api = ApiClient(base=f"http://127.0.0.1:{daemon.http_port}", http=http)
        refused = await api.call(
            "POST",
            "/devices/dev-1/commands",
            token=OPERATOR,
            json={"name": "set", "params": {"blob": "x" * LIMIT}},
        )
        assert refused.status == 422, refused.body
        assert refused.body["error"] == "DOWNLINK_TOO_LARGE"
        assert refused.body["limit"] == LIMIT
        assert refused.body["size"] > LIMIT
        assert await db.fetchval("SELECT count(*) FROM command") == 0
        accepted = await api.call(
            "POST",
            "/devices/dev-1/commands",
            token=OPERATOR,
            json={"name": "set", "params": {"blob": "x" * (LIMIT // 2)}},
        )
        assert accepted.status == 201, accepted.body
