"""The stream hub against real PostgreSQL: a stream that cannot keep up is dropped, and its
client resumes from its last event with nothing lost; only an alarm's creation that a stream
wrote pushes the alarm; the hub's passes are driven by hand."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncGenerator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from gateway.alarms.lifecycle import create_alarm
from gateway.api import stream as stream_module
from gateway.api.auth import Caller, Role
from gateway.api.stream import StreamHub
from gateway.config import parse_config
from gateway.domain.quiet_hours import QuietHours
from storage import alarms as alarm_repo
from storage import outbox
from storage.console import Cursor
from tests.support.sse import Sse
from tests.support.waiting import wait_until

WALL = Caller(name="wall-screen", role=Role.VIEWER)


class _Body:
    """A stream's body as the server would write it, read event by event (None: a comment)."""

    def __init__(self, hub: StreamHub, after: Cursor | None) -> None:
        self.chunks: AsyncGenerator[bytes, None] = hub.events(hub.open(WALL), after)
        self.pending: deque[Sse | None] = deque()

    async def next(self) -> Sse | None:
        while not self.pending:
            chunk = await anext(self.chunks)
            for block in chunk.decode().split("\n\n"):
                if block.startswith(":"):
                    self.pending.append(None)
                elif block:
                    fields = dict(line.split(": ", 1) for line in block.splitlines())
                    self.pending.append(
                        Sse(fields.get("id"), fields.get("event"), json.loads(fields["data"]))
                    )
        return self.pending.popleft()

    async def event(self) -> Sse:
        got = await self.next()
        assert got is not None
        return got

    async def rest(self) -> list[Sse | None]:
        """What is left, until the body ends."""
        left: list[Sse | None] = []
        while True:
            try:
                left.append(await self.next())
            except StopAsyncIteration:
                return left

    async def close(self) -> None:
        await self.chunks.aclose()


def _cursor(event: Sse) -> Cursor:
    assert event.id is not None
    xid, _, row_id = event.id.partition(":")
    return Cursor(int(xid), int(row_id))


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
    hub = StreamHub(pool, db_dsn, node_id="hub-test")
    assert await hub.run_once() == 0  # the first pass finds the head
    slow = _Body(hub, None)
    assert await slow.next() is None  # registered: the "live" comment
    fast = _Body(hub, None)
    assert await fast.next() is None
    assert hub.streams == 2

    names = [f"e{n}" for n in range(8)]
    await _events(pool, names[:4])
    await _passes_until(hub, 4)
    received = [await fast.event() for _ in range(4)]  # the fast one reads, the slow one not
    await _events(pool, names[4:])
    await _passes_until(hub, 4)
    assert hub.streams == 1  # the slow one, with 4 queued and 4 more, was dropped
    received += [await fast.event() for _ in range(4)]
    assert [e.data["aggregate_id"] for e in received] == names
    kept = await slow.rest()  # what was queued, then the end
    assert all(e is not None for e in kept)
    assert [e.data["aggregate_id"] for e in kept if e is not None] == names[:5]

    last = kept[-1]
    assert last is not None
    resumed = _Body(hub, _cursor(last))  # its client reconnects with Last-Event-ID
    rest = [await resumed.event() for _ in range(3)]
    assert [e.data["aggregate_id"] for e in rest] == names[5:]
    assert await resumed.next() is None  # caught up: live
    await _events(pool, ["next"])
    await _passes_until(hub, 1)
    after = await resumed.event()
    assert after.data["aggregate_id"] == "next"
    await slow.close()
    await fast.close()
    await resumed.close()
    assert hub.streams == 0


async def test_with_no_stream_the_hub_moves_its_head_without_reading_and_streams_catch_up(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """No stream open: a pass moves the head past what became final, fanning out nothing. A
    stream opened from now sees only what comes next; one resuming from an earlier cursor gets
    everything after it, in order, from the database."""
    hub = StreamHub(pool, db_dsn, node_id="hub-test")
    assert await hub.run_once() == 0  # the first pass finds the head
    await _events(pool, ["before"])
    await _head_moves(hub)
    early = _Body(hub, None)
    assert await early.next() is None  # registered after "before", before "a" and "b"
    await _events(pool, ["a", "b"])
    await _passes_until(hub, 2)
    seen = [await early.event() for _ in range(2)]
    await early.close()
    assert hub.streams == 0

    await _events(pool, ["c", "d", "e"])
    await _head_moves(hub)
    live = _Body(hub, None)
    assert await live.next() is None  # from now on: c, d, e are behind it
    await _events(pool, ["f"])
    await _passes_until(hub, 1)
    fresh = await live.event()
    assert fresh.data["aggregate_id"] == "f"
    resumed = _Body(hub, _cursor(seen[0]))  # a client that saw "a" reconnects
    rest = [await resumed.next() for _ in range(6)]
    assert [e.data["aggregate_id"] for e in rest if e is not None] == ["b", "c", "d", "e", "f"]
    assert rest[-1] is None  # then live
    await live.close()
    await resumed.close()


async def _head_moves(hub: StreamHub) -> None:
    """Passes with no stream open until the head moves on, each fanning out nothing."""
    start = hub.head
    assert start is not None

    async def moved() -> bool:
        assert await hub.run_once() == 0  # nothing fanned out: nobody listens
        return hub.head is not None and hub.head > start

    await wait_until(moved, message="the head moves on")


async def _raise(pool: asyncpg.Pool) -> int:
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id="door-1", rule_key="door", severity="MAJOR",
            telemetry_event_id=f"{1:064x}", reason="test", node_id="elsewhere",
            now=await alarm_repo.db_now(conn),
        )  # fmt: skip
    assert creation.alarm is not None
    return creation.alarm.id


async def test_only_a_stream_that_wrote_an_alarms_creation_pushes_it(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """Three streams are handed the same ``alarm.created`` frame: one whose client went away
    (its connection no longer stands when the server takes the chunk), one the hub cut with
    the frame still queued (its token revoked), and one that wrote it. Only the last pushes
    the alarm, in one round; the next round finds nothing to do."""
    hub = StreamHub(pool, db_dsn, node_id="hub-test")
    assert await hub.run_once() == 0
    gone = hub.events(
        hub.open(Caller(name="gone", role=Role.VIEWER), connected=lambda: False), None
    )
    cut = hub.events(hub.open(Caller(name="revoked", role=Role.VIEWER)), None)
    wall = _Body(hub, None)
    for body in (gone, cut):
        assert await anext(body) == stream_module.KEEPALIVE_FRAME
    assert await wall.next() is None
    alarm_id = await _raise(pool)
    await _passes_until(hub, 1)
    assert hub.revoke(lambda caller: caller.name != "revoked") == 1
    assert b"event: alarm.created" in await anext(cut)  # queued before the cut: yielded...
    with pytest.raises(StopAsyncIteration):
        await anext(cut)  # ... to a connection reset meanwhile
    assert b"event: alarm.created" in await anext(gone)
    created = await wall.event()
    assert created.event == "alarm.created"
    # One more event: the server asks each body for more, so their chunks were taken.
    await _events(pool, ["after"])
    await _passes_until(hub, 1)
    assert b"test.e" in await anext(gone)  # its client gone: written to nobody
    assert await hub.reach_once() == []
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "NEW"
    assert (await wall.event()).data["aggregate_id"] == "after"  # "alarm.created" was written
    assert await hub.reach_once() == [alarm_id]
    assert await hub.reach_once() == []
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "PUSHED"
        audit = await conn.fetch(
            "SELECT actor, node_id, note FROM alarm_audit WHERE action = 'push'"
        )
    assert [tuple(r) for r in audit] == [
        ("system:stream", "hub-test", "reached via console stream (token wall-screen)")
    ]
    await gone.aclose()
    await wall.close()


def _quiet_now() -> QuietHours | None:
    now = datetime.now(UTC)
    start, end = now - timedelta(hours=1), now + timedelta(hours=1)
    return parse_config(
        f'[[alarms.quiet_hours.windows]]\ndevices = "door-*"\n'
        f'start = "{start:%H:%M}"\nend = "{end:%H:%M}"\n'
    ).quiet_hours()


async def _status(pool: asyncpg.Pool, alarm_id: int) -> str:
    async with pool.acquire() as conn:
        return str(await conn.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id))


async def test_a_stream_does_not_push_an_alarm_that_quiet_hours_hold_back(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """Written inside quiet hours, the creation pushes nothing (the outbox publisher holds the
    alarm DELAYED; here it is not running, so it stays NEW). With the window gone (a reload),
    a client resuming from the start is written it again, and that pushes it."""
    quiet = _quiet_now()
    assert quiet is not None
    hub = StreamHub(pool, db_dsn, node_id="hub-test", quiet=quiet)
    assert await hub.run_once() == 0
    wall = _Body(hub, None)
    assert await wall.next() is None
    alarm_id = await _raise(pool)
    await _passes_until(hub, 1)
    assert (await wall.event()).event == "alarm.created"
    await _events(pool, ["after"])
    await _passes_until(hub, 1)
    assert (await wall.event()).data["aggregate_id"] == "after"  # the creation was written
    assert await hub.reach_once() == []
    assert await _status(pool, alarm_id) == "NEW"

    hub.quiet = None
    resumed = _Body(hub, Cursor(0, 0))
    assert [(await resumed.event()).event for _ in range(2)] == ["alarm.created", "test.e"]
    assert await resumed.next() is None  # live: the catch-up chunk was taken
    assert await hub.reach_once() == [alarm_id]
    assert await _status(pool, alarm_id) == "PUSHED"
    await wall.close()
    await resumed.close()
