"""The daemon and its service manager: readiness, watchdog, status (sd_notify).

``WATCHDOG=1`` is sent only while the pipeline is healthy: making progress, or idle. A
database call of the writer that has not returned for longer than the watchdog period means
the writer is stuck, and the pings stop so that systemd restarts the service (nothing is
lost: unacknowledged messages are redelivered). A database that refuses connections is not
"stuck": the writer fails fast and retries, and restarting would not help.

Such a restart is the database's doing: before it, the messages in flight are excused to the
crash-loop breaker (gateway/ingest/breaker.py), which would otherwise count it as their death
and, at the second, quarantine them. A hang of the process itself (the event loop blocked)
stops the pings without this and still counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from gateway.ingest.writer import IngestWriter
from gateway.runtime.sdnotify import Notifier
from gateway.support.loops import sleep_unless_stopped

log = structlog.get_logger(__name__)

# How long the watchdog tries to tell the crash-loop breaker, before a restart it withholds
# the pings for, that the messages in flight are not to blame.
EXCUSE_S = 2.0


class Watchdog:
    def __init__(
        self,
        *,
        notifier: Notifier,
        writer: IngestWriter,
        status: Callable[[], str],
        interval_s: float,
        stall_s: float,
    ) -> None:
        self.notifier = notifier
        self.writer = writer
        self.status = status
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.pings = 0

    def stuck_for(self, now: float) -> float:
        since = self.writer.in_db_call_since
        return 0.0 if since is None else now - since

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        warned = False
        while not stop.is_set():
            stuck = self.stuck_for(loop.time())
            if stuck < self.stall_s:
                self.notifier.watchdog()
                self.pings += 1
                warned = False
            else:
                # The restart is the database's doing, not the messages': at every tick until
                # it comes (a batch journaled meanwhile is excused too).
                excused = await self.writer.excuse_in_flight(min(self.interval_s, EXCUSE_S))
                if not warned:
                    log.error(
                        "watchdog_withheld",
                        stuck_s=round(stuck, 1),
                        note="a database write has not returned; systemd will restart us",
                        in_flight_excused=excused,
                    )
                    warned = True
            self.notifier.status(self.status())
            await sleep_unless_stopped(stop, self.interval_s)
