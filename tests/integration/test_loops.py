"""The LISTEN-or-poll loop: a NOTIFY that arrives while a pass runs is not lost."""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.loops import drain_on_notify

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
