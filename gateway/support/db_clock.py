"""The time of day on the database's clock, as a node estimates it.

Every decision of the gateway is taken on the database's clock (its ``now()``), alike on every
node. A few times are read before any statement can give them: the receive time that dates a
reading with no time of its own (docs/devices.md) is taken as the node reads it off the
broker. Read from the node's wall clock, it was as wrong as that clock: one node of three with
its NTP broken, minutes behind, dated each reading it read minutes before the others' (a
warm fridge's reading, read there, came after a normal one read on time elsewhere and was a
late sample: its alarm was raised cleared).

:class:`DatabaseClock` keeps the database's clock as an offset from the node's monotonic clock
(which no NTP step moves), measured by a round trip: ``clock_timestamp()`` against the middle
of the monotonic times before and after, off by at most half the round trip. It measures again
every ``SYNC_S`` and keeps, of the last ``KEPT`` measures, the one of the shortest round trip
(a busy moment's long one is the least exact), so the estimate neither jitters with the load
nor drifts. Until the first measure, it reads the node's wall clock.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Final

import asyncpg
import structlog

from gateway.support.loops import every
from storage.ingest import clock_now

log = structlog.get_logger(__name__)

SYNC_S: Final = 10.0
KEPT: Final = 6  # a minute of measures
# A node's wall clock this far from the database's is logged, once per change of a second.
WARN_S: Final = 5.0


class DatabaseClock:
    """``time()``: seconds since the epoch on the database's clock, as this node estimates it."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        # The database's clock minus the node's monotonic one (until measured: its wall clock).
        self.offset_s = time.time() - time.monotonic()
        self._measures: deque[tuple[float, float]] = deque(maxlen=KEPT)  # (round trip, offset)
        self._skew_logged = 0.0

    def time(self) -> float:
        return time.monotonic() + self.offset_s

    async def sync(self) -> float:
        """Measure again; the node's wall clock's skew from the database's (seconds, positive:
        the node's ahead)."""
        async with self.pool.acquire() as conn:
            before = time.monotonic()
            database = await clock_now(conn)
            after = time.monotonic()
        self._measures.append((after - before, database.timestamp() - (before + after) / 2))
        self.offset_s = min(self._measures)[1]
        skew = time.time() - self.time()
        if abs(skew) >= WARN_S and abs(skew - self._skew_logged) >= 1.0:
            self._skew_logged = skew
            log.warning(
                "node_clock_skew",
                skew_s=round(skew, 3),
                note="readings without a time of their own are dated on the database's clock; "
                "fix this node's clock",
            )
        return skew

    async def run(self, stop: asyncio.Event) -> None:
        await every(SYNC_S, stop, self.sync, name="database-clock")
