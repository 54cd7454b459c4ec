"""The operator API, wired as the daemon wires it, on a loopback port (no MQTT, no daemon)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import msgspec
from litestar import Litestar

from gateway.alarms.service import AlarmService
from gateway.api.app import build_app
from gateway.api.auth import BearerAuth
from gateway.api.health import BrokerHealth, DatabaseHealth, Health, IngestHealth
from gateway.api.server import ApiServer
from gateway.api.services import Services
from gateway.api.stream import StreamHub
from gateway.commands.service import CommandService
from gateway.config import TokenConfig, parse_config
from gateway.ingest import live_path
from gateway.notify.service import NotifyService
from gateway.support.metrics import Metrics
from storage.pool import create_pool

FAKE_HEALTH = Health(
    status="ok", node_id="api-test", version="test", database=DatabaseHealth(ok=True),
    broker=BrokerHealth(ok=True, subscribed=True, address=None, connections=0), audit_failures=0,
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
    hub: StreamHub


@contextlib.asynccontextmanager
async def serve_api(
    dsn: str, tokens: Sequence[TokenConfig], config_text: str | None = None
) -> AsyncIterator[Served]:
    """The API on a loopback port; ``config_text`` (TOML) configures the replay path (rules,
    encoding, node id "api-test" by default)."""
    pool = await create_pool(dsn, min_size=1, max_size=20)
    alarms = AlarmService(pool, node_id="api-test")
    commands = CommandService(pool, "api-test", 3600.0)
    auth = BearerAuth(tokens)
    config = parse_config(config_text or '[node]\nid = "api-test"\n')
    hub = StreamHub(pool, dsn, node_id="api-test")
    app = build_app(
        health_check=healthy, metrics=Metrics(), auth=auth,
        services=Services(
            alarms=alarms, commands=commands, pool=pool,
            replay_path=live_path.for_replay(config, Metrics()), stream_hub=hub,
            notifications=NotifyService(pool),
        ),
    )  # fmt: skip
    stop = asyncio.Event()
    hub_task = asyncio.create_task(hub.run(stop), name="stream-hub")
    try:
        async with ApiServer(app, "127.0.0.1", 0) as server:
            yield Served(f"http://127.0.0.1:{server.port}", app, alarms, commands, auth, hub)
            stop.set()  # the hub ends the open streams first: the server stops at once
            await hub_task
    finally:
        stop.set()
        await hub_task
        await pool.close()
