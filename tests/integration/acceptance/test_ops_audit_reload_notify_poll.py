"""`[notify] poll_s` and `batch` are reloaded on SIGHUP (config.example.toml: "Receivers and
routes are reloaded on SIGHUP, as are the keys below"): the consumer of the outbox, whose pass
also sends the grouped notifications' repeats, takes them at the reload. It kept the values it
started with: a poll of an hour stayed an hour."""

from __future__ import annotations

import asyncpg

from gateway.config import Config
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


async def test_a_reloaded_notify_poll_is_the_consumers_at_once(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    def config(poll_s: float, batch: int) -> Config:
        return make_config(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            extra=f"[notify]\npoll_s = {poll_s}\nbatch = {batch}\n",
        )

    async def passes() -> object:
        # Each pass of the consumer with no route to read for moves its horizon (updated_at).
        return await db.fetchval("SELECT updated_at FROM notify_consumer")

    async with running_daemon(config(3600, 100)) as daemon:

        async def passed() -> bool:
            return await passes() is not None

        await wait_until(passed, timeout=30, message="a first pass")
        daemon.reload(config(0.05, 7))
        assert daemon.components is not None
        assert daemon.components.notify_consumer.batch == 7
        seen: set[object] = set()

        async def passing() -> bool:
            seen.add(await passes())
            return len(seen) >= 3

        await wait_until(passing, timeout=10, message="passes every 0.05 s after the reload")
