"""The inactivity monitor judges a device silent only over time the node listened, up to the
query that judges it, even in a pass that read what the node heard before it had to wait.

A pass read the session's hearing (how long it has listened, its breaks) first, then, for each
inactivity rule, waited for a pooled database connection (a busy pool: an ingest burst, a slow
database) and judged with that reading. The session could go down during the wait: the break
it began was not among those the query left out, and a device that kept reporting to the
broker (its reports held there for the node's session) was alarmed silent, pushed to people,
and cleared once the session came back.

Forced deterministically with a real mosquitto behind a TCP proxy, the real daemon and a
device reporting every 0.2 s straight to the broker: the test takes every connection of the
node's pool, cuts the link while the monitor's pass waits, lets a silence pass, then gives the
pool back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiomqtt
import asyncpg
import pytest

from gateway.alarms.inactivity import InactivityMonitor
from protocol import Topics
from storage import alarms as alarms_repo
from tests.support.daemon import make_config, running_daemon, session_down
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
SILENT_S = 5
RULE = (
    f'[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = {SILENT_S}\n'
    'severity = "MAJOR"\n'
)


class Passes:
    """The node's inactivity passes, counted: begun, over, and their silence queries."""

    def __init__(self) -> None:
        self.begun = 0
        self.over = 0
        self.queries = 0


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> Passes:
    counted = Passes()
    run_once: Callable[[InactivityMonitor], Any] = InactivityMonitor.run_once
    silent_devices = alarms_repo.silent_devices

    async def counted_pass(self: InactivityMonitor) -> list[int]:
        counted.begun += 1
        try:
            return list(await run_once(self))
        finally:
            counted.over += 1

    async def counted_query(*args: Any, **kwargs: Any) -> Any:
        counted.queries += 1
        return await silent_devices(*args, **kwargs)

    monkeypatch.setattr(InactivityMonitor, "run_once", counted_pass)
    monkeypatch.setattr(alarms_repo, "silent_devices", counted_query)
    return counted


async def _beacon(port: int, stop: asyncio.Event, reporting: asyncio.Event) -> None:
    """A device reporting to the broker every 0.2 s while ``reporting``, straight (not through
    the proxy)."""
    async with aiomqtt.Client("127.0.0.1", port, identifier="beacon") as device:
        n = 0
        while not stop.is_set():
            n += 1
            if reporting.is_set():
                payload = f'{{"ts": {1_767_225_600_000 + n}, "metrics": {{"t": {n}}}}}'
                await device.publish(TOPICS.telemetry("beacon"), payload.encode(), qos=1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


async def test_a_pass_that_waited_for_a_connection_judges_no_silence_once_the_session_went_down(
    db_dsn: str, mosquitto: Mosquitto, passes: Passes
) -> None:
    db = await asyncpg.connect(db_dsn)
    stop = asyncio.Event()
    reporting = asyncio.Event()
    reporting.set()
    beacon: asyncio.Task[None] | None = None
    try:
        async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
            config = make_config(dsn=db_dsn, mqtt_port=proxy.port, node_id="node-a", extra=RULE)
            async with running_daemon(config) as daemon:
                session = daemon.session
                assert session is not None
                beacon = asyncio.create_task(_beacon(mosquitto.port, stop, reporting))

                async def heard() -> bool:
                    return bool(
                        await db.fetchval("SELECT count(*) FROM device WHERE device_id = 'beacon'")
                    )

                await wait_until(heard, timeout=30, message="the beacon heard")
                await wait_until(
                    lambda: session.hearing(SILENT_S).listening_s > 2 * SILENT_S,
                    timeout=30, message="listened for two silences",
                )  # fmt: skip
                # A moment's pause, everything received stored: the pass below reads a
                # hearing with no lag in it (a lag is a break up to the query: it would hide
                # the session's loss).
                reporting.clear()
                writer = daemon.writer
                assert writer is not None
                await wait_until(
                    lambda: writer.unstored_since is None, timeout=30, message="all stored"
                )
                pool = daemon.pool
                assert pool is not None
                async with contextlib.AsyncExitStack() as taken:
                    for _ in range(pool.get_max_size()):
                        await taken.enter_async_context(pool.acquire())
                    queries = passes.queries
                    # A pass began (its interval) and waits for a connection, before its query.
                    await wait_until(
                        lambda: passes.begun == passes.over + 1 and passes.queries == queries,
                        timeout=30, message="an inactivity pass waiting for a connection",
                    )  # fmt: skip
                    waiting = passes.begun
                    await proxy.cut()
                    await wait_until(
                        lambda: session_down(daemon), timeout=30, message="session down"
                    )
                    reporting.set()

                    # The beacon reports on, to the broker; the node hears none of it for
                    # longer than the rule's silence.
                    async def silence_passed() -> bool:
                        return bool(
                            await db.fetchval(
                                "SELECT now() - last_seen > make_interval(secs => $1)"
                                " FROM device WHERE device_id = 'beacon'",
                                SILENT_S + 1,
                            )
                        )

                    await wait_until(silence_passed, timeout=30, message="a silence passed")
                # The pool free again: the waiting pass goes on, and is over.
                await wait_until(
                    lambda: passes.over >= waiting, timeout=30, message="the waiting pass over"
                )
                alarms = await db.fetch(
                    "SELECT device_id, rule_key, reason FROM alarm WHERE device_id = 'beacon'"
                )
                assert alarms == [], (
                    "the beacon kept reporting to the broker, and was alarmed silent while the"
                    f" node's session was down: {[tuple(a) for a in alarms]}"
                )
                await proxy.resume()
                await wait_until(lambda: session.subscribed, timeout=60, message="subscribed again")
    finally:
        stop.set()
        if beacon is not None:
            await beacon
        await db.close()
