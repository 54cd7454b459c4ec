"""The operator API, wired as the daemon wires it, on a loopback port (no MQTT, no daemon)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import msgspec
from litestar import Litestar

from gateway.alarms.service import AlarmService
from gateway.api.app import Services, build_app
from gateway.api.auth import BearerAuth
from gateway.api.health import BrokerHealth, DatabaseHealth, Health, IngestHealth
from gateway.api.server import ApiServer
from gateway.commands.service import CommandService
from gateway.config import TokenConfig
from gateway.support.metrics import Metrics
from storage.pool import create_pool

FAKE_HEALTH = Health(
    status="ok", node_id="api-test", version="test", database=DatabaseHealth(ok=True),
    broker=BrokerHealth(ok=True, address=None, connections=0), audit_failures=0,
    ingest=IngestHealth(queued=0, seconds_since_progress=None),
)  # fmt: skip
FAKE_HEALTH_JSON = msgspec.to_builtins(FAKE_HEALTH)


async def healthy() -> tuple[bool, Health]:
    return True, FAKE_HEALTH


@dataclass
class Served:
    base: str
    app: Litestar
    alarms: AlarmService
    commands: CommandService
    auth: BearerAuth


@contextlib.asynccontextmanager
async def serve_api(dsn: str, tokens: Sequence[TokenConfig]) -> AsyncIterator[Served]:
    pool = await create_pool(dsn, min_size=1, max_size=20)
    alarms = AlarmService(pool, node_id="api-test")
    commands = CommandService(pool, "api-test", 3600.0)
    auth = BearerAuth(tokens)
    app = build_app(
        health_check=healthy, metrics=Metrics(), auth=auth,
        services=Services(alarms=alarms, commands=commands),
    )  # fmt: skip
    try:
        async with ApiServer(app, "127.0.0.1", 0) as server:
            yield Served(f"http://127.0.0.1:{server.port}", app, alarms, commands, auth)
    finally:
        await pool.close()
