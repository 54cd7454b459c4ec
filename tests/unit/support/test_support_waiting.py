"""The deadline-bounded waits every other test relies on instead of sleeps."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.waiting import wait_until, wait_until_sync


async def test_returns_once_a_concurrent_task_makes_the_predicate_true() -> None:
    asked = asyncio.Event()
    ready = False
    calls = 0

    def predicate() -> bool:
        nonlocal calls
        calls += 1
        asked.set()
        return ready

    async def make_ready() -> None:
        nonlocal ready
        await asked.wait()
        ready = True

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(make_ready(), name="make_ready")
        await wait_until(predicate, timeout=5.0, message="ready")

    assert ready
    assert calls >= 2, "the predicate was false first, so it must have been polled again"


async def test_accepts_an_async_predicate() -> None:
    answers = iter([False, False, True])

    async def predicate() -> bool:
        await asyncio.sleep(0)
        return next(answers)

    await wait_until(predicate, timeout=5.0)

    assert next(answers, None) is None


async def test_raises_after_the_timeout_with_the_message() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()

    with pytest.raises(AssertionError, match=r"condition not met within 0\.1s: broker up"):
        await wait_until(lambda: False, timeout=0.1, interval=0.01, message="broker up")

    assert loop.time() - started >= 0.1


async def test_predicate_errors_propagate() -> None:
    def predicate() -> bool:
        raise LookupError("no such row")

    with pytest.raises(LookupError, match="no such row"):
        await wait_until(predicate, timeout=5.0)


def test_sync_returns_when_the_predicate_becomes_true() -> None:
    answers = iter([False, False, True])

    wait_until_sync(lambda: next(answers), timeout=5.0, interval=0.001)

    assert next(answers, None) is None


def test_sync_raises_after_the_timeout() -> None:
    started = time.monotonic()

    with pytest.raises(AssertionError, match=r"condition not met within 0\.05s: port open"):
        wait_until_sync(lambda: False, timeout=0.05, interval=0.01, message="port open")

    assert time.monotonic() - started >= 0.05
