"""Background loops shared by the periodic workers (timers, inactivity, reaper)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import asyncpg
import structlog

log = structlog.get_logger("gateway.loops")

# A pass that fails on these is tried again at the next tick; anything else is a bug and
# ends the daemon (the task group fails loudly rather than looping on it).
RETRYABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)


async def sleep_unless_stopped(stop: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or less if ``stop`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


async def every(
    interval_s: float, stop: asyncio.Event, step: Callable[[], Awaitable[object]], *, name: str
) -> None:
    """Run ``step`` every ``interval_s`` until ``stop``; a failed pass is logged and retried."""
    while not stop.is_set():
        try:
            await step()
        except RETRYABLE as exc:
            log.warning("periodic_step_failed", loop=name, error=repr(exc))
        await sleep_unless_stopped(stop, interval_s)


async def wait_event_or_stop(event: asyncio.Event, stop: asyncio.Event, timeout_s: float) -> None:
    """Return when ``event`` or ``stop`` is set, or after ``timeout_s`` (polling fallback)."""
    waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()


async def drain_on_notify(
    *,
    dsn: str,
    channel: str,
    stop: asyncio.Event,
    step: Callable[[], Awaitable[int]],
    poll_s: float,
    name: str,
) -> None:
    """Run ``step`` until it finds nothing, then wait for a NOTIFY on ``channel`` (or
    ``poll_s``, the fallback), until ``stop``. A dedicated connection LISTENs; without one
    (the database refused it) this is a plain poll."""
    wakeup = asyncio.Event()
    listener: asyncpg.Connection | None = None
    try:
        listener = await asyncpg.connect(dsn)
        await listener.add_listener(channel, lambda *_: wakeup.set())
    except (OSError, asyncpg.PostgresError) as exc:
        log.warning("listen_failed", loop=name, channel=channel, error=repr(exc),
                    fallback="polling")  # fmt: skip
        listener = None
    try:
        while not stop.is_set():
            # Cleared before the step, never after: a NOTIFY arriving while the step runs
            # (work committed just after its query looked) must end the wait below at once.
            wakeup.clear()
            try:
                if await step():
                    continue  # there may be more
            except RETRYABLE as exc:
                log.warning("periodic_step_failed", loop=name, error=repr(exc))
            await wait_event_or_stop(wakeup, stop, poll_s)
    finally:
        if listener is not None:
            with contextlib.suppress(Exception):
                await listener.close()
