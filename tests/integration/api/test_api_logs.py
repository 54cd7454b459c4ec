"""No log line ever carries a configured token or password, whatever a request sends.

A real ``gateway run`` with JSON logs at info level, three tokens, a broker password and a
database password; hostile requests over raw sockets (a NUL after a valid token, a huge header
with the token in it, malformed JSON, the token as a path, a request id, a device id, a body
field...). None is answered 5xx, and the daemon's whole log, read after it stopped, has none of
the secrets in it (the aiohttp API logged a traceback quoting the Authorization header).
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from pathlib import Path
from typing import Final

import asyncpg

from gateway.api.auth import REFUSAL_LOG_LINES
from tests.support.api_client import ADMIN, OPERATOR, VIEWER
from tests.support.daemon import DaemonProcess, config_toml
from tests.support.dsn import with_database
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

MQTT_PASSWORD: Final = "mqtt-Passw0rd-0123456789"
DB_PASSWORD: Final = "db-Passw0rd-0123456789"
SECRETS: Final = (VIEWER, OPERATOR, ADMIN, MQTT_PASSWORD, DB_PASSWORD)
TOKENS_TOML: Final = "".join(
    f'\n[[api.tokens]]\ntoken = "{token}"\nrole = "{role}"\nname = "{role}"\n'
    for role, token in (("viewer", VIEWER), ("operator", OPERATOR), ("admin", ADMIN))
)


def _request(
    method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    if body:
        lines.append(b"Content-Type: application/json")
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _bearer(token: str, suffix: bytes = b"") -> tuple[bytes, bytes]:
    return b"Authorization", b"Bearer " + token.encode() + suffix


HOSTILE: Final = {
    "nul-after-valid-token": _request("GET", "/alarms", [_bearer(OPERATOR, b"\x00")]),
    "nul-inside-token": _request(
        "GET",
        "/alarms",
        [(b"Authorization", b"Bearer " + OPERATOR[:8].encode() + b"\x00" + OPERATOR[8:].encode())],
    ),
    "nul-in-request-id": _request("GET", "/alarms", [_bearer(ADMIN), (b"X-Request-Id", b"a\x00")]),
    "control-chars-after-token": _request("GET", "/alarms", [_bearer(ADMIN, b"\x01\x7f\xff")]),
    "huge-header-with-token": _request(
        "GET", "/alarms", [_bearer(VIEWER), (b"X-Junk", VIEWER.encode() * 4000)]
    ),
    "huge-authorization": _request("GET", "/alarms", [_bearer(ADMIN, b"x" * 200_000)]),
    "many-headers": _request(
        "GET", "/alarms", [_bearer(VIEWER), *((f"X-H{n}".encode(), b"v") for n in range(500))]
    ),
    "basic-with-token": _request(
        "GET",
        "/alarms",
        [(b"Authorization", b"Basic " + base64.b64encode(f"u:{ADMIN}".encode()))],
    ),
    "unknown-token-is-a-password": _request("GET", "/alarms", [_bearer(MQTT_PASSWORD)]),
    "token-as-path": _request("GET", f"/alarms/{ADMIN}", []),
    "token-as-query": _request("GET", f"/alarms?device={OPERATOR}", [_bearer(VIEWER)]),
    "token-as-request-id": _request(
        "POST",
        "/devices/dev-1/commands",
        [_bearer(OPERATOR), (b"X-Request-Id", ADMIN.encode())],
        b'{"name": "reboot"}',
    ),
    "token-as-device-and-name": _request(
        "POST",
        f"/devices/{VIEWER}/commands",
        [_bearer(OPERATOR)],
        f'{{"name": "{DB_PASSWORD}"}}'.encode(),
    ),
    "token-as-actor": _request(
        "POST", "/alarms/1/confirm", [_bearer(OPERATOR)], f'{{"actor": "{ADMIN}"}}'.encode()
    ),
    "token-in-the-stream-url": _request("GET", f"/stream?token={ADMIN}", []),
    "token-as-stream-ticket": _request("GET", f"/stream?ticket={ADMIN}", []),
    "token-as-stream-cursor": _request(
        "GET", "/stream", [_bearer(ADMIN), (b"Last-Event-ID", ADMIN.encode())]
    ),
    "bad-json-with-token": _request(
        "POST", "/devices/dev-1/commands", [_bearer(OPERATOR)], f'{{"name": "{ADMIN}'.encode()
    ),
    "nul-in-body": _request(
        "POST",
        "/devices/dev-1/commands",
        [_bearer(OPERATOR)],
        f'{{"name": "a\\u0000{ADMIN}"}}'.encode(),
    ),
    "garbage-request-line": ADMIN.encode() + b"\x00 / HTTP/1.1\r\n\r\n",
    "bad-content-length": _request(
        "POST", "/devices/dev-1/commands", [_bearer(OPERATOR), (b"Content-Length", b"x")]
    ),
}


async def _send(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(30):
            return await reader.read(65536)
    except ConnectionError:
        return b""  # the server may close on a request it cannot parse
    finally:
        writer.close()


async def test_no_log_line_carries_a_secret(
    pg_server_dsn: str, template_db: str, tmp_path: Path, mosquitto: Mosquitto
) -> None:
    name = f"gw_logs_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_server_dsn)
    await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    await admin.close()
    dsn = with_database(pg_server_dsn, name).replace("postgres@", f"postgres:{DB_PASSWORD}@", 1)
    port = free_port()
    workdir = tmp_path
    config = workdir / "gateway.toml"
    config.write_text(
        config_toml(
            dsn=dsn,
            mqtt_port=mosquitto.port,
            http_port=port,
            log_level="info",
            mqtt_extra=f'username = "gw"\npassword = "{MQTT_PASSWORD}"',
            extra=TOKENS_TOML,
        )
    )
    daemon = DaemonProcess(config, workdir / "gateway.log")
    try:
        daemon.start()

        async def healthy() -> bool:
            try:
                reply = await _send(port, _request("GET", "/health", []))
            except OSError:
                return False
            return reply.startswith(b"HTTP/1.1 200")

        await wait_until(healthy, timeout=60, message="daemon healthy")
        answers = {label: await _send(port, raw) for label, raw in HOSTILE.items()}
        assert daemon.terminate() == 0
    finally:
        daemon.cleanup()
        admin = await asyncpg.connect(pg_server_dsn)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    for label, answer in answers.items():
        status = answer.split(b"\r\n", 1)[0]
        assert not status.startswith(b"HTTP/1.1 5"), (label, answer[:300])
    log = daemon.log_text()
    assert '"api_access_refused"' in log  # it logged the refusals: the check below means something
    assert '"command_created"' in log
    for line in log.splitlines():
        for secret in SECRETS:
            assert secret not in line, line[:500]


async def test_refused_and_unknown_parameter_requests_do_not_flood_the_log(
    db_dsn: str, tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """``GET /health?x=1`` (an unknown parameter: 400) was an ERROR line per request, a refused
    request a WARNING line each: anyone reaching the port could fill the journal. Now the
    first is no line at all, refusals are info lines, at most a few a minute."""
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(
            dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, log_level="info",
            extra=TOKENS_TOML,
        )
    )  # fmt: skip
    daemon = DaemonProcess(config, tmp_path / "gateway.log")
    try:
        daemon.start()

        async def healthy() -> bool:
            try:
                reply = await _send(port, _request("GET", "/health", []))
            except OSError:
                return False
            return reply.startswith(b"HTTP/1.1 200")

        await wait_until(healthy, timeout=60, message="daemon healthy")
        probes = [await _send(port, _request("GET", "/health?x=1", [])) for _ in range(100)]
        refused = [await _send(port, _request("GET", "/alarms", [])) for _ in range(100)]
        wrong_token = _request("GET", "/alarms", [_bearer(MQTT_PASSWORD)])
        unknown = [await _send(port, wrong_token) for _ in range(100)]
        assert daemon.terminate() == 0
    finally:
        daemon.cleanup()
    assert {p.split(b"\r\n", 1)[0] for p in probes} == {b"HTTP/1.1 400 Bad Request"}
    assert {r.split(b"\r\n", 1)[0] for r in refused + unknown} == {b"HTTP/1.1 401 Unauthorized"}
    records = [json.loads(line) for line in daemon.log_text().splitlines() if line.startswith("{")]
    assert not [r for r in records if r["level"] in ("error", "critical")], records[-5:]
    assert not [r for r in records if "/health" in json.dumps(r)]
    refusals = [r for r in records if r["event"] == "api_access_refused"]
    assert 1 <= len(refusals) <= REFUSAL_LOG_LINES, len(refusals)
    assert {r["level"] for r in refusals} == {"info"}
