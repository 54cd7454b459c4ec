"""Presence stored by two nodes in the order of their commits, not of their receipts: a node a
batch behind stores a device's Will `offline` after another node stored the newer `online`
of a session takeover (both published within milliseconds). Each node's store steps are run
directly, on one database, with the receipt times the session stamps (the loop's clock), the
order forced by holding one node's transaction open."""

from __future__ import annotations

import time
from types import SimpleNamespace

import asyncpg
import pytest

from gateway.alarms.engine import AlarmEngine
from gateway.alarms.inactivity import InactivityMonitor
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.store import store
from gateway.support.metrics import Metrics
from protocol import Encoding, Topics
from storage import ingest as repo

TOPICS = Topics("iot")
DECODER = MessageDecoder(TOPICS, Encoding.JSON, 65536)
SILENT_300 = compile_rules(
    [RuleConfig(key="silent", kind="inactivity", severity="WARNING", silent_seconds=300)]
)
DEVICE = "dev-flap"


def _status(value: str, received_at: float, device: str = DEVICE) -> Inbound:
    return Inbound(TOPICS.device_status(device), value.encode(), received_at)


async def _warm(conn: asyncpg.Connection, node: str) -> None:
    """What a node's connection has done before: stored a presence (asyncpg prepares the
    statement on its first use, a round trip before it starts: see docs/rules-and-alarms.md
    for what that does to the receipt)."""
    await _store(conn, node, _status("online", time.monotonic(), device=f"other-{node}"))


async def _store(conn: asyncpg.Connection, node: str, *items: Inbound) -> None:
    await store(conn, DECODER.classify(list(items)), node)


async def _presence(db: asyncpg.Connection) -> str:
    value = await db.fetchval("SELECT presence FROM device WHERE device_id = $1", DEVICE)
    assert isinstance(value, str)
    return value


def _monitor(pool: asyncpg.Pool) -> InactivityMonitor:
    engine = AlarmEngine(rules=SILENT_300, node_id="node-c", metrics=Metrics())
    return InactivityMonitor(pool=pool, engine=engine, interval_s=1)


async def _online_since_a_while(db: asyncpg.Connection) -> None:
    """The device was born an hour ago (stored by node A), last heard 30 s ago."""
    await _store(db, "node-a", _status("online", time.monotonic() - 2.0))
    await db.execute(
        "UPDATE device SET first_seen = now() - interval '1 hour', presence_at = now() -"
        " interval '1 hour', last_seen = now() - interval '30 seconds' WHERE device_id = $1",
        DEVICE,
    )


@pytest.mark.parametrize("b_read_the_will_too", [False, True], ids=["online", "will+online"])
async def test_a_lagging_nodes_older_will_stored_after_the_newer_online_leaves_it_online(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str, b_read_the_will_too: bool
) -> None:
    """A session takeover: node A reads the old session's Will `offline`, node B the new
    session's `online` 50 ms later (with the Will before it, in the same batch: no change
    it stores). A takeover's gap is milliseconds; 50 ms is wider than what a loaded test
    machine can add between a receipt's age and its statement (docs/rules-and-alarms.md).
    A's batch is held (its transaction open, behind a slow one) while B commits; then A
    commits its `offline`. The device is online: it used to end `offline`, and a pass
    of the inactivity monitor right then raised a "presence offline" alarm that stayed until
    the device's next message."""
    await _online_since_a_while(db)
    will_read_by_a = time.monotonic() - 0.300
    online_read_by_b = will_read_by_a + 0.050
    node_a = await asyncpg.connect(db_dsn)
    try:
        await _warm(node_a, "node-a")
        held = node_a.transaction()
        await held.start()  # A's batch, under way before B's
        b_items = [_status("online", online_read_by_b)]
        if b_read_the_will_too:
            b_items.insert(0, _status("offline", will_read_by_a + 0.001))
        async with pool.acquire() as node_b:
            await _warm(node_b, "node-b")
            async with node_b.transaction():
                await _store(node_b, "node-b", *b_items)
        assert await _presence(db) == "online"
        await _store(node_a, "node-a", _status("offline", will_read_by_a))
        await held.commit()
    finally:
        await node_a.close()
    assert await _presence(db) == "online"
    assert await _monitor(pool).run_once() == []
    # A's next batch: the `online` it read after the Will (its own order, the broker's).
    await _store(db, "node-a", _status("online", online_read_by_b + 0.001))
    assert await _presence(db) == "online"


async def test_a_newer_offline_from_another_node_is_stored_and_alarmed(
    db: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """The order kept is the receipts': node B's Will read after A's `online` is stored,
    and raises its "presence offline" alarm, as before."""
    await _online_since_a_while(db)
    online_read_by_a = time.monotonic() - 0.300
    await _store(db, "node-a", _status("online", online_read_by_a))
    await _store(db, "node-b", _status("offline", online_read_by_a + 0.050))
    assert await _presence(db) == "offline"
    assert len(await _monitor(pool).run_once()) == 1


async def test_one_nodes_presence_follows_its_own_order_whatever_its_receipts_say(
    db: asyncpg.Connection,
) -> None:
    """A single node: each change is stored in the order it reads them (the broker's), as
    before, even where its receipt looks older than the one stored (a statement's way to the
    database is not always as long): the node's own order is the broker's."""
    await _online_since_a_while(db)
    read = time.monotonic() - 0.050
    await _store(db, "node-a", _status("offline", read))
    assert await _presence(db) == "offline"
    await _store(db, "node-a", _status("online", read - 0.010))
    assert await _presence(db) == "online"
    await _store(db, "node-a", _status("offline", read - 0.020))
    assert await _presence(db) == "offline"


async def test_a_repeated_presence_read_later_moves_only_its_receipt_not_the_silence(
    db: asyncpg.Connection,
) -> None:
    """The retained status read again on a reconnect is no new silence (presence_at stays),
    but it is a newer reading: a Will another node read before it is older."""
    await _online_since_a_while(db)
    before = await db.fetchrow("SELECT * FROM device WHERE device_id = $1", DEVICE)
    reread = time.monotonic() - 0.100
    await _store(db, "node-b", _status("online", reread))
    after = await db.fetchrow("SELECT * FROM device WHERE device_id = $1", DEVICE)
    assert after["presence_at"] == before["presence_at"]
    assert after["presence_received_at"] > before["presence_received_at"]
    assert after["presence_node"] == "node-b"
    await _store(db, "node-a", _status("offline", reread - 0.050))
    assert await _presence(db) == "online"
    assert await repo.record_presence(db, {}) is None


async def test_a_lagging_nodes_will_held_through_a_long_database_outage_leaves_it_online(
    db: asyncpg.Connection, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL away for more than an hour (a failover gone wrong, a full disk): the
    writers hold their batches and store them again and again until it is back, so the
    takeover read meanwhile reaches the database with ages over an hour. Node B stores the
    new session's `online` first, then node A its batch with the older Will. The device is
    online: the receipts' ages were dropped beyond an hour ("not on this clock"), and with
    no receipt the Will was applied in commit order, the fault of a node a batch behind
    again, and a pass of the monitor raised "presence offline". (The nodes' monotonic clock
    is moved on by 4,000 s, as on a machine up for longer than this test's may be.)"""
    shifted = SimpleNamespace(monotonic=lambda: time.monotonic() + 4000.0)
    monkeypatch.setattr(repo, "time", shifted)
    now = shifted.monotonic()
    await _store(db, "node-a", _status("online", now - 3800.0))  # born before the outage
    await db.execute(
        "UPDATE device SET first_seen = now() - interval '2 hours', presence_at = now() -"
        " interval '2 hours', last_seen = now() - interval '30 seconds' WHERE device_id = $1",
        DEVICE,
    )
    will_read_by_a = now - 3700.300
    online_read_by_b = will_read_by_a + 0.050
    await _store(db, "node-b", _status("online", online_read_by_b))
    await _store(db, "node-a", _status("offline", will_read_by_a))
    assert await _presence(db) == "online"
    assert await _monitor(pool).run_once() == []


async def test_a_receipt_stored_on_a_clock_ahead_does_not_freeze_the_presence(
    db: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """A failover to a standby whose clock is a minute behind the old primary's (or the
    database host's clock stepped back a minute): the receipts stored before it are a minute
    ahead of every receipt stored since (shifted here as the old clock wrote them). Node A
    stored the device's `online` on the old primary and went down with it; node B reads the
    device's Will `offline` now. It is stored and alarmed: it was refused for that minute,
    a receipt "read after" its own, so only node A could change the device's presence (the
    same node), and the device looked online, its silence unalarmed."""
    await _online_since_a_while(db)
    await db.execute(
        "UPDATE device SET presence_received_at = presence_received_at + interval '1 minute'"
        " WHERE device_id = $1",
        DEVICE,
    )
    await _store(db, "node-b", _status("offline", time.monotonic() - 0.010))
    assert await _presence(db) == "offline"
    assert len(await _monitor(pool).run_once()) == 1
