"""A reload (SIGHUP) that comes while the node is still starting (waiting for its database,
as after a power cut that took the database down too) applies all of itself once the node is
up, the API tokens included: a token the operator removed is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import asyncpg

from gateway.config import parse_config
from gateway.runtime.daemon import Daemon
from tests.support.api_client import ADMIN, OPERATOR
from tests.support.daemon import READY_TIMEOUT_S, config_toml
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


def _tokens(token: str, name: str) -> str:
    return f"""
[[api.tokens]]
token = "{token}"
role = "admin"
name = "{name}"

[[rules]]
key = "{name}-door"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
"""


async def _status(http: aiohttp.ClientSession, port: int | None, token: str) -> int:
    async with http.get(
        f"http://127.0.0.1:{port}/rules", headers={"Authorization": f"Bearer {token}"}
    ) as reply:
        return reply.status


async def test_a_reload_while_waiting_for_the_database_swaps_the_tokens_too(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    await proxy.cut()  # the database is out of reach when the node starts
    dsn = through(db_dsn, proxy)

    def config(token: str, name: str) -> str:
        return config_toml(dsn=dsn, mqtt_port=mosquitto.port, extra=_tokens(token, name))

    daemon = Daemon(parse_config(config(OPERATOR, "leaked")))
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        await wait_until(
            lambda: "waiting for the database" in (daemon.starting or ""),
            timeout=READY_TIMEOUT_S,
            message="the node waits for its database",
        )
        # The operator removes the leaked token, adds a new one and reloads (SIGHUP).
        daemon.reload(parse_config(config(ADMIN, "fresh")))
        await proxy.resume()
        await _serves_the_reloaded_file(daemon)
    finally:
        stop.set()
        async with asyncio.timeout(60):
            await task
        await proxy.stop()


async def _serves_the_reloaded_file(daemon: Daemon) -> None:
    """Ready, with the reloaded file's rules and tokens, none of the first file's."""
    async with asyncio.timeout(READY_TIMEOUT_S):
        await daemon.ready.wait()
    assert daemon.components is not None
    assert [rule.key for rule in daemon.components.engine.rules.rules] == ["fresh-door"]
    async with aiohttp.ClientSession() as http:
        assert await _status(http, daemon.http_port, ADMIN) == 200
        assert await _status(http, daemon.http_port, OPERATOR) == 401


async def test_a_reload_while_the_node_builds_its_parts_is_applied_to_them(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """The SIGHUP lands while the node loads its rules (its first statements on the database
    held by a lock): the parts built from the file as it was take the reloaded one."""

    def config(token: str, name: str) -> str:
        return config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, extra=_tokens(token, name))

    blocker = await asyncpg.connect(db_dsn)
    watcher = await asyncpg.connect(db_dsn)
    held = blocker.transaction()
    await held.start()
    await blocker.execute("LOCK TABLE node_rule_set IN ACCESS EXCLUSIVE MODE")
    daemon = Daemon(parse_config(config(OPERATOR, "leaked")))
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:

        async def loading_blocked() -> bool:
            # Not on the blocker: its transaction reads one snapshot of the statistics.
            waiting = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            return daemon.starting == "loading the rules" and waiting > 0

        await wait_until(loading_blocked, timeout=READY_TIMEOUT_S, message="rules loading held")
        daemon.reload(parse_config(config(ADMIN, "fresh")))
        await held.rollback()
        await _serves_the_reloaded_file(daemon)
    finally:
        stop.set()
        async with asyncio.timeout(60):
            await task
        await blocker.close()
        await watcher.close()
