"""Wait for a condition with a deadline, instead of sleeping for "long enough".

Polling is the sanctioned way to wait for something outside our event loop (a broker process,
a row written by another connection); ``interval`` bounds the cost, ``timeout`` bounds the wait.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


def _timed_out(timeout: float, message: str) -> AssertionError:
    return AssertionError(f"condition not met within {timeout}s: {message}")


async def wait_until(
    predicate: Callable[[], Awaitable[bool] | bool],
    *,
    # A polling deadline, not a cancellation scope: asyncio.timeout() would cancel the
    # predicate mid-await and lose the "not met within" message.
    timeout: float = 30.0,  # noqa: ASYNC109 - a deadline, not a cancellation timeout
    interval: float = 0.02,
    message: str = "",
) -> None:
    """Return once ``predicate()`` is true; raise ``AssertionError`` after ``timeout`` seconds.

    ``predicate`` may be a plain function or return an awaitable. Exceptions it raises propagate.
    The predicate is always evaluated at least once, and once more at the deadline.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        outcome = predicate()
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome:
            return
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise _timed_out(timeout, message)
        await asyncio.sleep(min(interval, remaining))


def wait_until_sync(
    predicate: Callable[[], bool],
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    message: str = "",
) -> None:
    """Blocking twin of :func:`wait_until`, for synchronous setup code (starting processes)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(timeout, message)
        time.sleep(min(interval, remaining))
