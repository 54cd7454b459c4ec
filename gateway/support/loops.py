"""Background loops shared by the periodic workers (timers, inactivity, reaper)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import asyncpg
import structlog

from gateway.support.backoff import Backoff
from storage.errors import DB_ERRORS
from storage.pool import alive, connect

log = structlog.get_logger(__name__)

# A pass that fails on these is tried again later, with backoff: whatever the database or its
# driver raises (a cut connection, a restarting server) must not end the daemon. Anything else
# is a bug and ends it (the task group fails loudly rather than looping on it).
RETRYABLE: tuple[type[BaseException], ...] = DB_ERRORS
# What a probe of a LISTEN connection may end with: no answer in time, or any of the above.
_PROBE_FAILED: tuple[type[BaseException], ...] = (TimeoutError, *RETRYABLE)
# Consecutive failed passes wait longer and longer, up to this (or the loop's own interval).
FAILURE_BACKOFF_CAP_S = 30.0
# An idle loop (nothing configured for it) looks again this often even if no reload woke it.
IDLE_RECHECK_S = 3600.0
# A LISTEN connection that cannot be opened must not hold up the passes for long.
LISTEN_CONNECT_TIMEOUT_S = 10.0
# Closing one: past this, it is cut (a server gone silent never acknowledges the close, and a
# stop must not wait for it; a LISTEN connection has nothing to flush).
LISTEN_CLOSE_TIMEOUT_S = 1.0
# A LISTEN connection idles: a host gone silent under it (power, a partition, a failover that
# left the old primary's machine unreachable: nothing reset) is never noticed by waiting on it,
# and its loop polled for the rest of the process's life. Silent this long (no notification, no
# answer), it is asked once; no answer within LISTEN_PROBE_TIMEOUT_S, it is cut and opened again
# (on the next host of a multi-host DSN that answers). TCP keepalive would notice too, but
# asyncpg sets none of its timings (the kernel's default waits over two hours).
LISTEN_PROBE_S = 20.0
LISTEN_PROBE_TIMEOUT_S = 5.0


def failure_backoff(interval_s: float) -> Backoff:
    """Delays after failed passes: from ``interval_s`` doubling up to the cap."""
    return Backoff(interval_s, max(interval_s, FAILURE_BACKOFF_CAP_S))


def failure_delay(interval_s: float, backoff: Backoff) -> float:
    """The wait after a failed pass of a loop whose interval (or poll) is ``interval_s``:
    the backoff's next delay, never shorter than ``interval_s`` nor longer than
    ``FAILURE_BACKOFF_CAP_S`` (a loop whose interval is longer retries at the cap)."""
    return min(max(interval_s, backoff.next_delay()), FAILURE_BACKOFF_CAP_S)


async def sleep_unless_stopped(stop: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or less if ``stop`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


async def every(
    interval_s: float | Callable[[], float],
    stop: asyncio.Event,
    step: Callable[[], Awaitable[object]],
    *,
    name: str,
) -> None:
    """Run ``step`` every ``interval_s`` until ``stop``; a failed pass is logged and retried
    after a growing delay, never shorter than ``interval_s`` nor longer than
    ``FAILURE_BACKOFF_CAP_S`` (a loop whose interval is longer retries at the cap: the hourly
    maintenance pass, failed by a database restart of a few seconds, waited the whole hour).
    A callable ``interval_s`` is read after each pass, for the wait that follows it (a reload
    may change it, and so may what the pass found)."""

    def interval() -> float:
        return interval_s() if callable(interval_s) else interval_s

    backoff = failure_backoff(interval())
    while not stop.is_set():
        try:
            await step()
        except RETRYABLE as exc:
            delay = failure_delay(interval(), backoff)
            log.warning(
                "periodic_step_failed", loop=name, error=repr(exc), retry_in_s=round(delay, 3)
            )
        else:
            backoff.reset()
            delay = interval()
        await sleep_unless_stopped(stop, delay)


async def every_while_configured(
    interval_s: Callable[[], float | None],
    stop: asyncio.Event,
    step: Callable[[], Awaitable[object]],
    *,
    wakeup: asyncio.Event,
    name: str,
) -> None:
    """Like :func:`every`, for a loop the configuration may switch on and off at run time:
    ``interval_s()`` (read again before each pass) is None while there is nothing to do, and
    the loop then waits, with no query, for ``wakeup`` (set by a reload) or ``stop``. A reload
    that sets ``wakeup`` also ends a wait between passes, so a new interval applies at once.

    Such a loop runs from start on every node whatever the configuration, so that what a
    reload brings in needs no task started by hand (and what it removes, none stopped).

    A failed pass is retried as :func:`every` retries one: after a growing delay, never longer
    than ``FAILURE_BACKOFF_CAP_S`` (the figures' gauges, sampled hourly if so configured, were
    left an hour old by a database restart of a few seconds).
    """
    backoff: Backoff | None = None
    while not stop.is_set():
        wakeup.clear()  # before reading the configuration: a reload meanwhile ends the wait
        interval = interval_s()
        if interval is None:
            backoff = None
            await wait_event_or_stop(wakeup, stop, IDLE_RECHECK_S)
            continue
        if backoff is None:
            backoff = failure_backoff(interval)
        delay = interval
        try:
            await step()
        except RETRYABLE as exc:
            # Retried as every() retries: never later than the cap, whatever the interval.
            delay = failure_delay(interval, backoff)
            log.warning(
                "periodic_step_failed", loop=name, error=repr(exc), retry_in_s=round(delay, 3)
            )
        else:
            backoff.reset()
            # What the pass found may shorten the wait (a monitor that could not judge yet).
            after = interval_s()
            if after is not None:
                delay = min(delay, after)
        await wait_event_or_stop(wakeup, stop, delay)


async def wait_event_or_stop(event: asyncio.Event, stop: asyncio.Event, timeout_s: float) -> None:
    """Return when ``event`` or ``stop`` is set, or after ``timeout_s`` (polling fallback)."""
    waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()


class _Listener:
    """A dedicated connection LISTENing on one channel, opened again after it was lost.

    A restarted server or a terminated backend closes it silently: without reopening, the
    loop would fall back to polling for the rest of the process's life.
    """

    def __init__(
        self,
        dsn: str,
        channel: str,
        wakeup: asyncio.Event,
        name: str,
        *,
        probe_s: float = LISTEN_PROBE_S,
        probe_timeout_s: float = LISTEN_PROBE_TIMEOUT_S,
        connect_timeout_s: float = LISTEN_CONNECT_TIMEOUT_S,
    ) -> None:
        self.dsn = dsn
        self.channel = channel
        self.wakeup = wakeup
        self.name = name
        self.probe_s = probe_s
        self.probe_timeout_s = probe_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.connection: asyncpg.Connection | None = None
        self.backoff = failure_backoff(1.0)
        self.next_attempt = 0.0
        # When the server was last heard on the connection (loop time): opened, a
        # notification, an answer to the probe.
        self.heard_at = 0.0

    @property
    def listening(self) -> bool:
        """Whether the connection is open (then its LISTEN was accepted)."""
        return self.connection is not None and not self.connection.is_closed()

    async def ensure(self) -> None:
        """Open the connection if there is none (at most once per backoff delay), or if the
        server did not answer the probe on it (see ``LISTEN_PROBE_S``)."""
        loop = asyncio.get_running_loop()
        if self.listening and (loop.time() - self.heard_at < self.probe_s or await self._answers()):
            return
        if loop.time() < self.next_attempt:
            return
        await self.close()
        try:
            connection = await connect(self.dsn, timeout=self.connect_timeout_s)
        except RETRYABLE as exc:
            delay = self.backoff.next_delay()
            self.next_attempt = loop.time() + delay
            log.warning(
                "listen_failed",
                loop=self.name,
                channel=self.channel,
                error=repr(exc),
                fallback="polling",
                retry_in_s=round(delay, 3),
            )
            return
        try:
            await connection.add_listener(self.channel, self._notified)
        except RETRYABLE as exc:
            self.next_attempt = loop.time() + self.backoff.next_delay()
            log.warning(
                "listen_failed",
                loop=self.name,
                channel=self.channel,
                error=repr(exc),
                fallback="polling",
            )
            with contextlib.suppress(Exception):
                await connection.close(timeout=LISTEN_CLOSE_TIMEOUT_S)
            return
        # Lost later (a restart, a terminated backend): wake the loop, whose next wait opens
        # it again, instead of sleeping until the poll.
        connection.add_termination_listener(lambda *_: self.wakeup.set())
        self.connection = connection
        self.heard_at = loop.time()
        self.backoff.reset()
        # Whatever was notified while nobody listened: look once, at once.
        self.wakeup.set()

    def wait_s(self, poll_s: float) -> float:
        """How long the loop may wait for a wake-up: ``poll_s``, or less while there is no
        connection and its next attempt comes sooner. A LISTEN lost or refused part way (the
        backend terminated while it ran) installs no termination listener and sets no
        wake-up: without this bound it was tried again only after the poll."""
        now = asyncio.get_running_loop().time()
        if self.listening:
            # Back by the probe's time: a loop with a long poll asks a silent server in time.
            return min(poll_s, max(self.heard_at + self.probe_s - now, 0.0))
        return min(poll_s, max(self.next_attempt - now, 0.0))

    def _notified(self, *_: object) -> None:
        self.heard_at = asyncio.get_running_loop().time()
        self.wakeup.set()

    async def _answers(self) -> bool:
        """Probe the connection; one that does not answer is cut (and the loop, polling
        meanwhile, opens another)."""
        connection = self.connection
        assert connection is not None
        try:
            await alive(connection, timeout=self.probe_timeout_s)
        except _PROBE_FAILED as exc:
            log.warning(
                "listen_silent",
                loop=self.name,
                channel=self.channel,
                error=repr(exc),
                note="the server did not answer on the LISTEN connection: opening another",
            )
            self.connection = None
            # Cut, not closed: a close waits for the silent server's acknowledgement.
            with contextlib.suppress(Exception):
                connection.terminate()
            return False
        self.heard_at = asyncio.get_running_loop().time()
        return True

    async def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close(timeout=LISTEN_CLOSE_TIMEOUT_S)


# For loops that wait on more than one wake-up (see gateway.notify.worker).
Listener = _Listener


async def drain_on_notify(
    *,
    dsn: str,
    channel: str,
    stop: asyncio.Event,
    step: Callable[[], Awaitable[int]],
    poll_s: float | Callable[[], float],
    name: str,
    wakeup: asyncio.Event | None = None,
) -> None:
    """Run ``step`` until it finds nothing, then wait for a NOTIFY on ``channel`` (or
    ``poll_s``, the fallback), until ``stop``. A dedicated connection LISTENs; without one
    (the database refused it, or it was lost and is not back yet) this is a plain poll. A
    failed pass is retried after a growing delay, never longer than ``FAILURE_BACKOFF_CAP_S``
    whatever ``poll_s`` (as :func:`every` retries). ``wakeup``, when given, is the event the
    NOTIFY sets: whoever else sets it (the broker session, on reconnect) wakes the loop too.
    A callable ``poll_s`` is read at each wait (a reload may change it)."""

    def poll() -> float:
        return poll_s() if callable(poll_s) else poll_s

    wakeup = asyncio.Event() if wakeup is None else wakeup
    listener = _Listener(dsn, channel, wakeup, name)
    backoff = failure_backoff(poll())
    try:
        await listener.ensure()
        while not stop.is_set():
            # Cleared before the step, never after: a NOTIFY arriving while the step runs
            # (work committed just after its query looked) must end the wait below at once.
            wakeup.clear()
            try:
                if await step():
                    backoff.reset()
                    continue  # there may be more
            except RETRYABLE as exc:
                # Never later than the cap, whatever the poll: a long poll_s (nothing but the
                # fallback to a NOTIFY) left a pass failed by a database blip waiting all of it.
                delay = failure_delay(poll(), backoff)
                log.warning(
                    "periodic_step_failed", loop=name, error=repr(exc), retry_in_s=round(delay, 3)
                )
                await sleep_unless_stopped(stop, delay)
                await listener.ensure()
                continue
            backoff.reset()
            await listener.ensure()
            await wait_event_or_stop(wakeup, stop, listener.wait_s(poll()))
    finally:
        await listener.close()
