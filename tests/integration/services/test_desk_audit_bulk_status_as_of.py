"""A bulk action over a group read with a status filter and its `as_of`: an alarm that joined
that status after the read (a DELAYED alarm woken to NEW, the group read with status=NEW) was
not in the group anybody saw; the as_of snapshot bounds the status as it bounds creation."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from gateway.alarms.lifecycle import create_alarm, transition
from gateway.alarms.service import AlarmService, Filters
from gateway.api.alarms import split_as_of
from gateway.domain.alarm import Action
from storage.alarms import db_now


@pytest.fixture
def service(pool: asyncpg.Pool) -> AlarmService:
    return AlarmService(pool, "n1", shelve_max_s=3600.0, bulk_max=5)


async def _raise(db: asyncpg.Connection, device: str) -> int:
    async with db.transaction():
        created = await create_alarm(
            db, device_id=device, rule_key="hot", severity="MAJOR",
            telemetry_event_id=uuid.uuid4().hex, reason="test", node_id="n",
            now=await db_now(db),
        )  # fmt: skip
    assert created.alarm is not None
    return created.alarm.id


async def _step(db: asyncpg.Connection, alarm_id: int, action: Action) -> None:
    async with db.transaction():
        await transition(db, alarm_id, action, actor="system:quiet-hours", node_id="n")


async def test_an_alarm_woken_to_the_status_after_the_read_is_not_in_the_group(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    held = await _raise(db, "d1")
    await _step(db, held, Action.DELAY)  # DELAYED: not in a status=NEW group
    seen = await _raise(db, "d2")  # NEW
    read = await service.groups(Filters(statuses=["NEW"]), by="rule", limit=10)
    assert [(g["key"], g["count"]) for g in read] == [("hot", 1)]
    as_of = split_as_of(str(read[0]["as_of"]))
    await _step(db, held, Action.WAKE)  # NEW now, after the read
    ids = await service.group_ids(Filters(statuses=["NEW"]), by="rule", key="hot", as_of=as_of)
    assert ids == [seen]
    # A step since on an alarm that was NEW in the read leaves it in the group it was in.
    await _step(db, seen, Action.DELAY)
    await _step(db, seen, Action.WAKE)
    ids = await service.group_ids(Filters(statuses=["NEW"]), by="rule", key="hot", as_of=as_of)
    assert ids == [seen]
    # Without as_of: the group as it is now.
    now = await service.group_ids(Filters(statuses=["NEW"]), by="rule", key="hot")
    assert sorted(now) == sorted([held, seen])
