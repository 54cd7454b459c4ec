"""A person's step on an alarm that reached someone while the step was on its way. The open
console's own stream (or a subscriber) pushes each new alarm (NEW -> PUSHED, a system's step);
a person who read the alarm NEW and acted got 409 STATUS_CHANGED when that push committed
between the read and the write: with consoles open, acting on fresh alarms was refused by the
alarms' reaching the person acting. A delivery decides nothing: the step applies from PUSHED.
Another person's step meanwhile is still a race lost. The interleaving is forced: the push (or
the other step) holds the alarm's row until the person's request waits for it."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from gateway.alarms.delivery import deliver
from gateway.alarms.lifecycle import StatusChangedError, create_alarm, transition
from gateway.alarms.service import AlarmService
from gateway.domain.alarm import Action, Alarm, AlarmStatus
from storage import alarms as repo
from tests.support.held_batch import lock_waiters
from tests.support.waiting import wait_until


async def _raise(pool: asyncpg.Pool) -> int:
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id="door-1", rule_key="door", severity="MAJOR",
            telemetry_event_id=f"{1:064x}", reason="test", node_id="n1",
            now=await repo.db_now(conn),
        )  # fmt: skip
    assert creation.alarm is not None
    return creation.alarm.id


async def _overtaken_by(
    pool: asyncpg.Pool, db_dsn: str, alarm_id: int, step: str
) -> asyncio.Task[Alarm]:
    """alice's confirm, read NEW, waiting on the row while ``step`` holds it; then committed."""
    holder = await asyncpg.connect(db_dsn)
    try:
        tx = holder.transaction()
        await tx.start()
        if step == "push":
            pushed = await deliver(
                holder, alarm_id, quiet=None, node_id="n2", reached="console stream"
            )
            assert pushed is AlarmStatus.PUSHED
        else:
            await transition(
                holder, alarm_id, Action.FALSE, actor="bob", node_id="n2",
                expected=AlarmStatus.NEW,
            )  # fmt: skip
        acting = asyncio.create_task(
            AlarmService(pool, "n1").act(alarm_id, Action.CONFIRM, actor="alice")
        )

        async def waiting() -> bool:
            return bool(await lock_waiters(db_dsn))

        await wait_until(waiting, message="alice's step waits on the row")
        assert not acting.done()
        await tx.commit()
    finally:
        await holder.close()
    return acting


async def test_a_step_overtaken_by_the_alarms_push_applies_from_pushed(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    alarm_id = await _raise(pool)
    acting = await _overtaken_by(pool, db_dsn, alarm_id, "push")
    changed = await acting
    assert changed.status is AlarmStatus.CONFIRMED
    async with pool.acquire() as conn:
        trail = await conn.fetch(
            "SELECT action, from_status, to_status, actor FROM alarm_audit"
            " WHERE alarm_id = $1 ORDER BY id",
            alarm_id,
        )
    assert [tuple(r) for r in trail] == [
        ("create", None, "NEW", "system:rules"),
        ("push", "NEW", "PUSHED", "system:outbox"),
        ("confirm", "PUSHED", "CONFIRMED", "alice"),
    ]


async def test_a_step_overtaken_by_another_persons_is_still_a_race_lost(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    alarm_id = await _raise(pool)
    acting = await _overtaken_by(pool, db_dsn, alarm_id, "false")
    with pytest.raises(StatusChangedError) as lost:
        await acting
    assert (lost.value.current.status, lost.value.actor) == (AlarmStatus.FALSE, "bob")
