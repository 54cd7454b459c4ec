"""A stop while the database's host has gone silent ends within the service manager's stop
timeout.

A host that dies (power, a network partition) resets nothing: every connection to it stays
open and carries nothing, and a new one is never answered. docs/behaviour.md §13: SIGTERM
drains the daemon and it exits 0 within the stop timeout (``TimeoutStopSec=45`` in the unit).
A call under way on such a link waits out the pool's command timeout (60 s), then the pool's
release waits for asyncpg's cancel request, which nobody answers either.

The link goes silent through a TCP proxy that drops every byte a client sends from then on
(to the established connections and to new ones); the test waits until the daemon's calls
have been swallowed (its loops poll every second), then stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from gateway.runtime.daemon import Daemon
from tests.support.daemon import make_config
from tests.support.dsn import proxy_for, through
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

# The unit's TimeoutStopSec is 45 s, and the drain (nothing queued here) is immediate.
STOP_BUDGET_S = 20.0


async def test_a_stop_with_the_database_silent_ends_within_the_stop_timeout(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    config = make_config(dsn=through(db_dsn, proxy), mqtt_port=mosquitto.port, node_id="silent")
    daemon = Daemon(config)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop), name="daemon")
    swallowed = 0

    def silent(_chunk: bytes) -> bool:
        nonlocal swallowed
        swallowed += 1
        return False

    try:
        ready = asyncio.ensure_future(daemon.ready.wait())
        await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert daemon.ready.is_set(), "the daemon did not start"
        proxy.from_client = silent
        # Queries of several loops (the dispatcher, the outbox, the reaper...) now wait.
        await wait_until(lambda: swallowed >= 3, timeout=30, message="calls under way")
        started = time.monotonic()
        stop.set()
        # The unit's TimeoutStopSec: systemd's SIGKILL comes then.
        await asyncio.wait({task}, timeout=45)
        took = time.monotonic() - started
        assert task.done(), f"still stopping after {took:.0f} s"
        assert task.exception() is None
        assert took < STOP_BUDGET_S, f"the stop took {took:.1f} s"
    finally:
        stop.set()
        proxy.from_client = None
        await proxy.stop()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
