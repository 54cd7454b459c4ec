"""What the benchmark's own database reports at each commit, instead of polling it.

Counting rows every few milliseconds to see when a drain ends took a PostgreSQL core of its
own (a 300,000-row count, 200 times a second): the measurement slowed what it measured. Here,
triggers in the benchmark's throwaway database notify, once per statement, what it stored:
telemetry rows per node (and the publish stamps the latency phase carries), alarms raised per
node, commands finished per device group. PostgreSQL delivers a notification when its
transaction commits, so the time one arrives is the commit time, on the benchmark's clock.

Each payload carries a sequence number: PostgreSQL folds identical notifications of one
transaction, and two statements storing the same counts would otherwise count once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import asyncpg

from sim.sql import blocks

Q: Final = blocks("bench.sql")
CHANNELS: Final = ("bench_stored", "bench_alarms", "bench_finished", "bench_stamps")


def _future() -> asyncio.Future[float]:
    return asyncio.get_running_loop().create_future()


@dataclass
class _Waiter:
    condition: Callable[[], bool]
    done: asyncio.Future[float] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Probes:
    """Counters fed by the probes' notifications, and waits on them.

    ``stored``: telemetry rows per node id; ``alarms``: alarms per node id; ``finished``:
    commands that reached a terminal status, per device id prefix (up to the first ``-``);
    ``first_stored``: when each node's first rows committed. ``on_stamps`` gets each
    notification's publish stamps (µs) with the time it arrived.
    """

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.stored: Counter[str] = Counter()
        self.alarms: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.first_stored: dict[str, float] = {}
        self.on_stamps: Callable[[list[int], int], None] | None = None
        self._conn: asyncpg.Connection | None = None
        self._waiters: list[_Waiter] = []

    async def __aenter__(self) -> Probes:
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(Q["install_probes"])
            for channel in CHANNELS:
                await conn.add_listener(channel, self._received)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._conn is not None
        try:
            await self._conn.execute(Q["drop_probes"])
        finally:
            await self._conn.close()

    def _received(self, _conn: object, _pid: int, channel: str, payload: str) -> None:
        now = time.perf_counter()
        if channel == "bench_stamps":
            if self.on_stamps is not None:
                self.on_stamps([int(s) for s in payload.split(",")], time.time_ns() // 1000)
            return
        _, key, count = payload.split(" ")
        if channel == "bench_stored":
            self.stored[key] += int(count)
            self.first_stored.setdefault(key, now)
        elif channel == "bench_alarms":
            self.alarms[key] += int(count)
        else:
            self.finished[key] += int(count)
        for waiter in list(self._waiters):
            if waiter.condition():
                self._waiters.remove(waiter)
                if not waiter.done.done():
                    waiter.done.set_result(now)

    async def until(self, condition: Callable[[], bool], *, timeout_s: float, what: str) -> float:
        """The ``perf_counter`` time of the commit after which ``condition`` held."""
        if condition():
            return time.perf_counter()
        waiter = _Waiter(condition)
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter.done
        except TimeoutError:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}") from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
