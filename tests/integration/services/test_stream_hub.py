"""The stream hub against real PostgreSQL: a stream that cannot keep up is dropped, and its
client resumes from its last event with nothing lost; the hub's passes are driven by hand."""

from __future__ import annotations

import asyncpg
import pytest

from gateway.api import stream as stream_module
from gateway.api.stream import StreamHub
from storage import outbox
from tests.support.waiting import wait_until


async def _events(pool: asyncpg.Pool, names: list[str]) -> None:
    async with pool.acquire() as conn, conn.transaction():
        for name in names:
            await outbox.add_event(
                conn, aggregate_type="test", aggregate_id=name, event_type="test.e", payload={}
            )


async def _passes_until(hub: StreamHub, expected: int) -> None:
    """Hub passes until ``expected`` events went out: other transactions of the cluster (other
    tests' databases) may hold the horizon back for a moment."""
    delivered = 0

    async def more() -> bool:
        nonlocal delivered
        delivered += await hub.run_once()
        return delivered >= expected

    await wait_until(more, message=f"{expected} events fanned out")
    assert delivered == expected


async def test_a_slow_stream_is_dropped_and_resumes_without_a_gap(
    pool: asyncpg.Pool, db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_module, "QUEUE_MAX", 5)
    hub = StreamHub(pool, db_dsn)
    assert await hub.run_once() == 0  # the first pass finds the head
    slow = hub.events(None)
    assert await anext(slow) is None  # registered: the "live" comment
    fast = hub.events(None)
    assert await anext(fast) is None
    assert hub.streams == 2

    names = [f"e{n}" for n in range(8)]
    await _events(pool, names[:4])
    await _passes_until(hub, 4)
    received = [await anext(fast) for _ in range(4)]  # the fast one reads, the slow one not
    await _events(pool, names[4:])
    await _passes_until(hub, 4)
    assert hub.streams == 1  # the slow one, with 4 queued and 4 more, was dropped
    received += [await anext(fast) for _ in range(4)]
    assert [e.aggregate_id for e in received if e is not None] == names
    kept = []
    async for item in slow:  # what was queued, then the end
        assert item is not None
        kept.append(item)
    assert [e.aggregate_id for e in kept] == names[:5]

    resumed = hub.events(kept[-1].cursor)  # its client reconnects with Last-Event-ID
    rest = [await anext(resumed) for _ in range(3)]
    assert [e.aggregate_id for e in rest if e is not None] == names[5:]
    assert await anext(resumed) is None  # caught up: live
    await _events(pool, ["next"])
    await _passes_until(hub, 1)
    after = await anext(resumed)
    assert after is not None
    assert after.aggregate_id == "next"
    await slow.aclose()
    await fast.aclose()
    await resumed.aclose()
    assert hub.streams == 0


async def test_with_no_stream_the_hub_moves_its_head_without_reading_and_streams_catch_up(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """No stream open: a pass moves the head past what became final, fanning out nothing. A
    stream opened from now sees only what comes next; one resuming from an earlier cursor gets
    everything after it, in order, from the database."""
    hub = StreamHub(pool, db_dsn)
    assert await hub.run_once() == 0  # the first pass finds the head
    await _events(pool, ["before"])
    await _head_moves(hub)
    early = hub.events(None)
    assert await anext(early) is None  # registered after "before", before "a" and "b"
    await _events(pool, ["a", "b"])
    await _passes_until(hub, 2)
    seen = [await anext(early) for _ in range(2)]
    cursor = seen[0]
    assert cursor is not None
    await early.aclose()
    assert hub.streams == 0

    await _events(pool, ["c", "d", "e"])
    await _head_moves(hub)
    live = hub.events(None)
    assert await anext(live) is None  # from now on: c, d, e are behind it
    await _events(pool, ["f"])
    await _passes_until(hub, 1)
    fresh = await anext(live)
    assert fresh is not None
    assert fresh.aggregate_id == "f"
    resumed = hub.events(cursor.cursor)  # a client that saw "a" reconnects
    rest = [await anext(resumed) for _ in range(5)]
    assert [e.aggregate_id for e in rest if e is not None] == ["b", "c", "d", "e", "f"]
    await live.aclose()
    await resumed.aclose()


async def _head_moves(hub: StreamHub) -> None:
    """Passes with no stream open until the head moves on, each fanning out nothing."""
    start = hub.head
    assert start is not None

    async def moved() -> bool:
        assert await hub.run_once() == 0  # nothing fanned out: nobody listens
        return hub.head is not None and hub.head > start

    await wait_until(moved, message="the head moves on")
