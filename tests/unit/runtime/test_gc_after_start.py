"""What `gateway run` does with the garbage collector once the daemon is ready: the start's
objects frozen out of its reach, the youngest generation collected less often
(gateway.cli.commands.YOUNG_GC_THRESHOLD; measured in docs/performance.md)."""

from __future__ import annotations

import asyncio
import gc

from gateway.cli.commands import YOUNG_GC_THRESHOLD, _freeze_when_ready


async def test_once_ready_the_start_is_frozen_and_the_youngest_generation_runs_less_often() -> None:
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    ready = asyncio.Event()
    freezing = asyncio.create_task(_freeze_when_ready(ready))
    try:
        await asyncio.sleep(0)
        assert gc.get_threshold() == before  # not before the daemon is ready
        assert gc.get_freeze_count() == frozen
        ready.set()
        await freezing
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert before[0] < YOUNG_GC_THRESHOLD
