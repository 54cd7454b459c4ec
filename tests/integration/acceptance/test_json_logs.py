"""With ``[log] format = "json"`` every line a daemon writes parses, through the faults an edge
host meets: the database cut mid-stream, the broker restarted, bad HTTP requests. And none of
those lines carries a configured token or password.

A real ``gateway run`` (both broker protocols: 3.1.1 runs on aiomqtt and paho, whose records
come through the standard library), a password-protected mosquitto, the database behind a TCP
proxy that cuts every connection.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Final

import aiohttp
import aiomqtt
import asyncpg
import pytest

from protocol import Topics
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream
from tests.support.api_client import ADMIN, OPERATOR, VIEWER
from tests.support.credentials import password_file
from tests.support.daemon import DaemonProcess, config_toml, count_rows
from tests.support.dsn import proxy_for, with_database
from tests.support.gateway_cli import Finished
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS: Final = Topics("iot")
MQTT_USER: Final = "gw"
MQTT_PASSWORD: Final = "mqtt-Passw0rd-json-4242"
DB_PASSWORD: Final = "db-Passw0rd-json-4242"
SECRETS: Final = (VIEWER, OPERATOR, ADMIN, MQTT_PASSWORD, DB_PASSWORD)
TOKENS_TOML: Final = "".join(
    f'\n[[api.tokens]]\ntoken = "{token}"\nrole = "{role}"\nname = "{role}"\n'
    for role, token in (("viewer", VIEWER), ("operator", OPERATOR), ("admin", ADMIN))
)
BAD_HTTP: Final = (
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # a TLS hello
    b"POST /alarms/1/confirm HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
    + ADMIN.encode()
    + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /alarms HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
    + MQTT_PASSWORD.encode()
    + b"\r\n\r\n",
)


async def _send_raw(port: int, raw: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(10):
            await reader.read(65536)
    except ConnectionError:
        pass  # the server may close on what it cannot parse
    finally:
        writer.close()


async def _status(port: int) -> int | None:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/health") as response,
        ):
            return response.status
    except aiohttp.ClientError:
        return None


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_every_line_parses_through_faults_and_carries_no_secret(
    pg_server_dsn: str, template_db: str, tmp_path: Path, protocol: str
) -> None:
    name = f"gw_json_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_server_dsn)
    await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    await admin.close()
    dsn = with_database(pg_server_dsn, name)
    proxy = proxy_for(dsn)
    await proxy.start()
    passwords = password_file(tmp_path / "passwd", MQTT_USER, MQTT_PASSWORD)
    broker = Mosquitto(
        tmp_path / "mosquitto",
        max_inflight_messages=100,
        extra_config=f"allow_anonymous false\npassword_file {passwords}\n",
    )
    broker.start()
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(
            dsn=f"postgresql://postgres:{DB_PASSWORD}@127.0.0.1:{proxy.port}/{name}",
            mqtt_port=broker.port,
            protocol=protocol,
            http_port=http_port,
            log_level="info",
            mqtt_extra=f'username = "{MQTT_USER}"\npassword = "{MQTT_PASSWORD}"',
            ingest_extra="batch_max = 20\nlinger_ms = 0",
            extra=TOKENS_TOML,
        )
    )
    daemon = DaemonProcess(config, tmp_path / "gateway.log")
    stream = list(telemetry_stream(TOPICS, device_ids(20), 1500))

    async def publish(part: list[tuple[str, bytes]]) -> None:
        async with aiomqtt.Client(
            "127.0.0.1", broker.port, username=MQTT_USER, password=MQTT_PASSWORD
        ) as client:
            await publish_many(client, part, window=100)

    async def stored(n: int) -> bool:
        return await count_rows(dsn) >= n

    try:
        daemon.start()
        await wait_until(lambda: _is(http_port, 200), timeout=60, message="healthy")
        await publish(stream[:500])
        await wait_until(lambda: stored(500), timeout=60, message="first part stored")

        # The database cut mid-stream: every connection reset, new ones refused.
        await proxy.cut()
        publishing = asyncio.create_task(publish(stream[500:1000]))
        await wait_until(
            lambda: "database_unavailable" in daemon.log_text(), timeout=30, message="noticed"
        )
        await wait_until(lambda: _is(http_port, 503), timeout=30, message="503 while cut")
        await proxy.resume()
        await publishing
        await wait_until(lambda: stored(1000), timeout=60, message="stored after the cut")

        # The broker restarted.
        broker.restart()
        await wait_until(
            lambda: daemon.log_text().count('"broker_connected"') >= 2,
            timeout=60,
            message="reconnected",
        )
        await publish(stream[1000:])
        await wait_until(lambda: stored(1500), timeout=60, message="stored after the restart")

        # Bad HTTP.
        for raw in BAD_HTTP:
            await _send_raw(http_port, raw)
        assert await daemon_terminated(daemon) == 0
    finally:
        daemon.cleanup()
        broker.stop()
        await proxy.stop()
        admin = await asyncpg.connect(pg_server_dsn)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    done = Finished(0, daemon.log_text())
    records = done.records()
    events = {record["event"] for record in records}
    assert {"database_unavailable", "broker_connected", "daemon_stopped"} <= events, events
    # The database out of reach is named where it is, in the writer's lines as at start.
    cut = [r for r in records if r["event"] == "database_unavailable"]
    assert {r["database"] for r in cut} == {f"127.0.0.1:{proxy.port}/{name}"}, cut
    # The libraries' own records are among them, rendered the same way.
    assert any(str(r.get("logger", "")).startswith("uvicorn") for r in records), events
    for line in done.output.splitlines():
        for secret in SECRETS:
            assert secret not in line, line[:500]


async def _is(port: int, status: int) -> bool:
    return await _status(port) == status


async def daemon_terminated(daemon: DaemonProcess) -> int:
    return await asyncio.to_thread(daemon.terminate)
