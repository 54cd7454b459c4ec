"""A reload (SIGHUP) swaps every [notify] key (config.example.toml, docs/notifications.md): the
consumer's ``batch`` and ``poll_s`` too, which it used to keep from the start while the
delivery worker took the new ones. Real daemon, mosquitto and PostgreSQL."""

from __future__ import annotations

import asyncio

from gateway.config import Config
from gateway.support.loops import drain_on_notify
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto


def _config(dsn: str, port: int, batch: int, poll_s: float) -> Config:
    return make_config(
        dsn=dsn, mqtt_port=port, extra=f"[notify]\nbatch = {batch}\npoll_s = {poll_s}\n"
    )


async def test_a_reload_gives_the_consumer_the_new_batch_and_poll(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with running_daemon(_config(db_dsn, mosquitto.port, 100, 1.0)) as daemon:
        parts = daemon.components
        assert parts is not None
        assert (parts.notify_consumer.batch, parts.notify_consumer.poll_s) == (100, 1.0)
        daemon.reload(_config(db_dsn, mosquitto.port, 7, 0.25))
        assert (parts.notify_consumer.batch, parts.notify_consumer.poll_s) == (7, 0.25)
        assert (parts.notify_worker.settings.batch, parts.notify_worker.settings.poll_s) == (
            7, 0.25,
        )  # fmt: skip


async def test_the_loops_poll_is_read_at_each_wait(db_dsn: str) -> None:
    """The consumer's loop (drain_on_notify) takes ``poll_s`` as a callable: a poll a reload
    shortened ends the wait that follows, not only the waits after an hour-long one."""
    stop = asyncio.Event()
    poll = [3600.0]
    passes = 0

    async def step() -> int:
        nonlocal passes
        passes += 1
        if passes == 1:
            poll[0] = 0.05  # the reload, while the first pass runs
        else:
            stop.set()
        return 0

    async with asyncio.timeout(30):  # an hour's wait, were the poll read once
        await drain_on_notify(
            dsn=db_dsn, channel="test_poll", stop=stop, step=step, poll_s=lambda: poll[0],
            name="test",
        )  # fmt: skip
    assert passes == 2
