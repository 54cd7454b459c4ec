"""The LISTEN-or-poll loop: a NOTIFY that arrives while a pass runs is not lost, and a lost
LISTEN connection is opened again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from gateway.support.loops import drain_on_notify
from tests.support.waiting import wait_until

CHANNEL = "test_wakeup"


async def test_a_notify_during_an_empty_pass_starts_the_next_pass_at_once(db_dsn: str) -> None:
    notifier = await asyncpg.connect(db_dsn)
    observer = await asyncpg.connect(db_dsn)
    observed = asyncio.Event()
    await observer.add_listener(CHANNEL, lambda *_: observed.set())
    stop = asyncio.Event()
    passes = 0

    async def step() -> int:
        nonlocal passes
        passes += 1
        if passes == 1:
            await notifier.execute(f"NOTIFY {CHANNEL}")
            # Work committed after this pass looked: it finds nothing, while the NOTIFY is
            # already delivered (the observer saw it on its own connection).
            await observed.wait()
            return 0
        stop.set()  # the second pass came: the notification woke it
        return 0

    try:
        # Without the notification, the next pass would come only after an hour of polling.
        async with asyncio.timeout(30):
            await drain_on_notify(
                dsn=db_dsn, channel=CHANNEL, stop=stop, step=step, poll_s=3600, name="test"
            )
    finally:
        await notifier.close()
        await observer.close()
    assert passes == 2


async def test_a_lost_listen_connection_is_opened_again(db_dsn: str) -> None:
    admin = await asyncpg.connect(db_dsn)
    stop = asyncio.Event()
    passes = 0

    async def step() -> int:
        nonlocal passes
        passes += 1
        return 0

    loop = _hourly_loop(db_dsn, stop, step)
    try:
        first = await _cut_the_listener(admin)

        await wait_until(
            lambda: _listening_again(admin, first), timeout=30, message="a new LISTEN connection"
        )
        before = passes
        await admin.execute(f"NOTIFY {CHANNEL}")
        await wait_until(lambda: passes > before, timeout=30, message="woken by the NOTIFY")
    finally:
        await _stopped(loop, stop, admin)


async def test_a_listen_lost_while_it_runs_is_tried_again_after_its_backoff(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the test above can meet: the listener's backend terminated while its LISTEN
    runs. Forced here: the second LISTEN's backend is terminated just before the LISTEN is
    sent. No termination listener is installed then and no wake-up set: the loop must try
    again after the listener's backoff (1 s), not after its poll (an hour)."""
    admin = await asyncpg.connect(db_dsn)
    listens = 0
    add_listener = asyncpg.Connection.add_listener

    async def terminated_on_the_second(
        self: asyncpg.Connection, channel: str, callback: Callable[..., object]
    ) -> None:
        nonlocal listens
        listens += 1
        if listens == 2:
            killer = await asyncpg.connect(db_dsn)
            try:
                await killer.execute("SELECT pg_terminate_backend($1)", self.get_server_pid())
            finally:
                await killer.close()
        await add_listener(self, channel, callback)

    monkeypatch.setattr(asyncpg.Connection, "add_listener", terminated_on_the_second)

    stop = asyncio.Event()

    async def step() -> int:
        return 0

    loop = _hourly_loop(db_dsn, stop, step)
    try:
        first = await _cut_the_listener(admin)

        await wait_until(
            lambda: _listening_again(admin, first),
            timeout=30,
            message="a LISTEN after the lost one",
        )
        assert listens == 3
    finally:
        await _stopped(loop, stop, admin)


async def _listener_pid(admin: asyncpg.Connection) -> int | None:
    """The backend LISTENing on the channel (its last statement the LISTEN), if any."""
    pid = await admin.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND query = $1",
        f'LISTEN "{CHANNEL}"',
    )
    return None if pid is None else int(pid)


def _hourly_loop(
    db_dsn: str, stop: asyncio.Event, step: Callable[[], Awaitable[int]]
) -> asyncio.Task[None]:
    """The loop under test, polling once an hour: only a notification, or the loss of its
    listener, starts a pass."""
    return asyncio.create_task(
        drain_on_notify(dsn=db_dsn, channel=CHANNEL, stop=stop, step=step, poll_s=3600, name="t")
    )


async def _listening_again(admin: asyncpg.Connection, first: int | None) -> bool:
    pid = await _listener_pid(admin)
    return pid is not None and pid != first


async def _cut_the_listener(admin: asyncpg.Connection) -> int | None:
    """Once the loop LISTENs, terminate its backend; the backend's pid."""
    await wait_until(lambda: _is_not_none(_listener_pid(admin)), timeout=30)
    first = await _listener_pid(admin)
    await admin.execute("SELECT pg_terminate_backend($1)", first)
    return first


async def _stopped(
    loop: asyncio.Task[None], stop: asyncio.Event, admin: asyncpg.Connection
) -> None:
    stop.set()
    async with asyncio.timeout(30):
        await loop
    await admin.close()


async def _is_not_none(value: Awaitable[object]) -> bool:
    return await value is not None
