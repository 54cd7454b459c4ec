"""``/health`` with the database's host gone silent answers 503 within its own bound.

The check takes a pool connection and pings with a 2 s bound (``HEALTH_DB_TIMEOUT_S``), so that
a monitor gets a truthful 503 ("database: ...") at once (docs/deploying.md: "/health is
truthful"). On a connection whose server went silent (power, a partition: nothing reset), the
bound cancelled the ping, and the pool's release then waited for asyncpg's cancel request,
which nobody answers: the answer came a minute or more later (a monitor's own timeout first).

The link goes silent through a TCP proxy that drops every byte clients send; the check is
asked while the pool holds an idle connection (the one it hands out first).
"""

from __future__ import annotations

import asyncio
import time

from gateway.runtime.daemon import HEALTH_DB_TIMEOUT_S, Daemon
from tests.support.daemon import make_config
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


async def test_health_answers_503_within_its_bound_when_the_database_goes_silent(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    config = make_config(dsn=through(db_dsn, proxy), mqtt_port=mosquitto.port, node_id="hs")
    daemon = Daemon(config)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop), name="daemon")
    try:
        ready = asyncio.ensure_future(daemon.ready.wait())
        await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert daemon.ready.is_set(), "the daemon did not start"
        assert (await daemon.health())[0]
        pool = daemon.pool
        assert pool is not None
        await wait_until(lambda: pool.get_idle_size() >= 1, timeout=30, message="an idle conn")
        # Silent from now on; the check runs before any other task can take the idle one.
        proxy.from_client = lambda _chunk: False
        started = time.monotonic()
        checking = asyncio.ensure_future(daemon.health())
        await asyncio.wait({checking}, timeout=30)
        took = time.monotonic() - started
        assert checking.done(), f"no answer after {took:.0f} s"
        healthy, body = checking.result()
        assert not healthy
        assert str(body.reason).startswith("database: ")
        assert took < HEALTH_DB_TIMEOUT_S + 1.0, f"the check took {took:.1f} s"
    finally:
        stop.set()
        proxy.from_client = None
        await proxy.stop()
        await asyncio.wait({task}, timeout=60)
