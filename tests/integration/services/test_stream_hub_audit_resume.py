"""The stream hub audit: a client that resumes on a node whose hub has not yet passed the
client's cursor (it came from another node, or from a catch-up that read further than the
hub) must not be sent again what it already had (behaviour §9: no gap, no duplicate)."""

from __future__ import annotations

import asyncpg
import pytest

from gateway.api import stream as stream_module
from gateway.api.stream import StreamHub
from tests.integration.services.test_stream_hub import _Body, _cursor, _events, _passes_until


async def test_a_resume_from_a_cursor_past_the_hubs_head_gets_no_duplicate(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """Two nodes: node B's hub has fanned out a and b; node A's has not passed yet (its
    notification is late, or it polls). The client of B reconnects to A with b's id: it must
    get c next, not a and b again."""
    node_a = StreamHub(pool, db_dsn, node_id="node-a")
    node_b = StreamHub(pool, db_dsn, node_id="node-b")
    assert await node_a.run_once() == 0  # the first passes find the head
    assert await node_b.run_once() == 0
    watcher = _Body(node_a, None)  # someone is live on A: its hub reads what comes
    assert await watcher.next() is None
    on_b = _Body(node_b, None)
    assert await on_b.next() is None

    await _events(pool, ["a", "b"])
    await _passes_until(node_b, 2)
    seen = [await on_b.event() for _ in range(2)]
    assert [e.data["aggregate_id"] for e in seen] == ["a", "b"]
    await on_b.close()

    # B goes away; its client reconnects to A, whose hub has not read a and b yet.
    resumed = _Body(node_a, _cursor(seen[-1]))
    assert await resumed.next() is None  # its cursor is past A's head: live at once
    await _passes_until(node_a, 2)  # A's hub now fans out a and b (the watcher needs them)
    assert [(await watcher.event()).data["aggregate_id"] for _ in range(2)] == ["a", "b"]
    await _events(pool, ["c"])
    await _passes_until(node_a, 1)
    got = await resumed.event()
    assert got.data["aggregate_id"] == "c", f"resumed after b, sent {got.data['aggregate_id']}"
    await resumed.close()
    await watcher.close()


async def test_a_catch_up_that_reads_past_the_hubs_head_gets_no_duplicate(
    pool: asyncpg.Pool, db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's read stopped inside one transaction's events (a batch's limit; a campaign
    writes thousands in one). A stream catching up reads a batch that ends past the hub's
    head, and goes live: the hub's next pass must not send it those again."""
    monkeypatch.setattr(stream_module, "READ_BATCH", 3)
    hub = StreamHub(pool, db_dsn, node_id="node-a")
    assert await hub.run_once() == 0
    watcher = _Body(hub, None)
    assert await watcher.next() is None
    await _events(pool, ["zero"])
    await _passes_until(hub, 1)
    await _events(pool, ["first"])
    await _passes_until(hub, 1)
    await _events(pool, ["t1", "t2", "t3", "t4"])  # one transaction: final all at once
    await _passes_until(hub, 3)  # t1, t2, t3: the hub's head is t3
    zero = await watcher.event()
    assert zero.data["aggregate_id"] == "zero"
    resumed = _Body(hub, _cursor(zero))  # a client that saw "zero" reconnects
    # Reads of 3 from its cursor: first, t1, t2; then t3, t4 (up to t3's transaction).
    caught = [await resumed.next() for _ in range(6)]
    assert [e.data["aggregate_id"] for e in caught if e is not None] == [
        "first", "t1", "t2", "t3", "t4"
    ]  # fmt: skip
    assert caught[-1] is None  # live
    await _passes_until(hub, 1)  # t4, for the watcher
    await _events(pool, ["next"])
    await _passes_until(hub, 1)
    got = await resumed.event()
    assert got.data["aggregate_id"] == "next", f"live after t4, sent {got.data['aggregate_id']}"
    await resumed.close()
    await watcher.close()
