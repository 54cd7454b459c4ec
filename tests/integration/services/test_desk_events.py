"""The desk's events (docs/topics-and-payloads.md, ``shelf.*``, ``device.*``): each shelf made
or ended and each maintenance period set or ended writes one event in its transaction, naming
what it covers, whoever ends it (a person, the timers of two racing nodes, a renewing shelf)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import asyncpg
import msgspec
import pytest

from gateway.alarms.service import AlarmService
from gateway.alarms.shelving import ShelfEndedError
from gateway.alarms.timers import AlarmTimers
from storage.pool import create_pool
from tests.integration.services.test_alarm_desk import (
    _audit,
    _db_past,
    _device,
    _raise,
    service,
)
from tests.support.waiting import wait_until

__all__ = ["service"]  # the fixture, used here


async def _events(db: asyncpg.Connection, aggregate: str) -> list[tuple[str, str, Any]]:
    rows = await db.fetch(
        "SELECT event_type, aggregate_id, payload FROM outbox_event WHERE aggregate_type = $1 "
        "ORDER BY id",
        aggregate,
    )
    return [(r["event_type"], r["aggregate_id"], msgspec.json.decode(r["payload"])) for r in rows]


async def test_shelves_made_lifted_expired_and_renewed_each_write_one_event(
    db_dsn: str, service: AlarmService, db: asyncpg.Connection
) -> None:
    hot = await _raise(db, "d1", "hot")
    hot_again = await _raise(db, "d2", "hot")
    pair = await service.shelve(
        scope="pair", alarm_id=None, device_id="d1", rule_key="hot", seconds=600,
        reason="swap", actor="alice",
    )  # fmt: skip
    await service.lift(pair["id"], actor="bob")
    brief = await service.shelve(
        scope="alarm", alarm_id=hot_again, device_id=None, rule_key=None, seconds=0.2,
        reason="brief", actor="alice",
    )  # fmt: skip
    await wait_until(lambda: _db_past(db, brief["until"]), message="the until passes")
    later = brief["until"] + timedelta(seconds=1)

    async def clock(_conn: asyncpg.Connection):  # type: ignore[no-untyped-def]
        return later

    pools = [await create_pool(db_dsn, min_size=1, max_size=2) for _ in range(2)]
    try:
        timers = [
            AlarmTimers(pool=p, node_id=f"node-{n}", quiet=None, escalate_after_s=0,
                        repeat_interval_s=0, unreached_after_s=0, clock=clock)
            for n, p in enumerate(pools)
        ]  # fmt: skip
        await asyncio.gather(*(t.run_once() for t in timers))
    finally:
        for p in pools:
            await p.close()
    # A shelf past its until that no timer ended yet, renewed by a new one: ended, then made.
    stale = await service.shelve(
        scope="alarm", alarm_id=hot, device_id=None, rule_key=None, seconds=0.2,
        reason="again", actor="carol",
    )  # fmt: skip
    await wait_until(lambda: _db_past(db, stale["until"]), message="the until passes")
    renewed = await service.shelve(
        scope="alarm", alarm_id=hot, device_id=None, rule_key=None, seconds=60,
        reason="longer", actor="carol",
    )  # fmt: skip

    events = await _events(db, "shelf")
    steps = [
        (kind, int(shelf_id), p["alarm_ids"], p["actor"], p["shelf"]["end_reason"])
        for kind, shelf_id, p in events
    ]
    assert steps == [
        ("shelf.started", pair["id"], [hot], "alice", None),
        ("shelf.ended", pair["id"], [hot], "bob", "lifted"),
        ("shelf.started", brief["id"], [hot_again], "alice", None),
        ("shelf.ended", brief["id"], [hot_again], "system:shelving", "expired"),  # once
        ("shelf.started", stale["id"], [hot], "carol", None),
        ("shelf.ended", stale["id"], [hot], "system:shelving", "expired"),
        ("shelf.started", renewed["id"], [hot], "carol", None),
    ]
    # The shelf as GET /shelves/{id} shows it.
    assert events[0][2]["shelf"]["reason"] == "swap"
    assert events[0][2]["shelf"]["scope"] == "pair"
    assert events[1][2]["shelf"]["ended_by"] == "bob"


async def test_a_maintenance_period_set_replaced_and_ended_writes_its_events(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    await _device(db, "d1")
    first = await service.set_out_of_service("d1", reason="calibration", until=None,
                                             actor="alice")  # fmt: skip
    second = await service.set_out_of_service("d1", reason="seal", until=None, actor="bob")
    await service.end_out_of_service("d1", actor="carol")
    events = await _events(db, "device")
    assert [(kind, key, p["period"]["id"], p["actor"]) for kind, key, p in events] == [
        ("device.out_of_service", "d1", first["id"], "alice"),
        ("device.out_of_service", "d1", second["id"], "bob"),
        ("device.in_service", "d1", second["id"], "carol"),
    ]
    assert events[2][2]["period"]["ended_by"] == "carol"
    assert events[1][2]["period"]["reason"] == "seal"


async def test_lifting_a_shelf_past_its_until_that_no_timer_ended_ends_it_as_the_timer_would(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    """DELETE /shelves/{id} of a shelf past its until, before any node's timers passed: 409
    SHELF_ENDED, as before, and the shelf now reads ended (at its until, expired, by
    system:shelving, audited, its shelf.ended written): a GET after the 409 must not show it
    in force."""
    alarm_id = await _raise(db, "d1")
    shelf = await service.shelve(
        scope="alarm", alarm_id=alarm_id, device_id=None, rule_key=None, seconds=0.2,
        reason="brief", actor="alice",
    )  # fmt: skip
    await wait_until(lambda: _db_past(db, shelf["until"]), message="the until passes")
    with pytest.raises(ShelfEndedError):
        await service.lift(shelf["id"], actor="bob")
    ended = await service.shelf(shelf["id"])
    assert (ended["ended_at"], ended["end_reason"], ended["ended_by"]) == (
        shelf["until"], "expired", "system:shelving",
    )  # fmt: skip
    [audit] = await _audit(db, alarm_id, "unshelve")
    assert audit["actor"] == "system:shelving"
    assert [kind for kind, _, _ in await _events(db, "shelf")] == ["shelf.started", "shelf.ended"]
    # Asked again: the same answer, nothing more written.
    with pytest.raises(ShelfEndedError):
        await service.lift(shelf["id"], actor="bob")
    assert len(await _events(db, "shelf")) == 2
