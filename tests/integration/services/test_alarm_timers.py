"""Quiet hours, escalation and reminders with an injected clock (no sleeps)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import aiomqtt
import asyncpg
import pytest

from gateway.alarms.delivery import QUIET_ACTOR, hold
from gateway.alarms.lifecycle import create_alarm, transition
from gateway.alarms.service import AlarmService
from gateway.alarms.shelving import lift, set_out_of_service, shelve
from gateway.alarms.timers import AlarmTimers, TimerReport
from gateway.config import parse_config
from gateway.domain.alarm import Action, AlarmStatus
from gateway.domain.quiet_hours import (
    QuietHours,
    QuietHoursConfig,
    QuietWindowConfig,
    compile_quiet_hours,
)
from gateway.notify.consumer import NotifyConsumer
from gateway.notify.metrics import NotifyMetrics
from gateway.notify.worker import DeliveryWorker
from gateway.outbox.publisher import OutboxPublisher
from gateway.support.metrics import Metrics
from protocol import Topics
from storage import alarms as repo
from tests.support.held_batch import lock_waiters
from tests.support.mosquitto import Mosquitto, events_subscriber
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

TOPICS = Topics("iot")


async def _raise(pool: asyncpg.Pool, device: str, severity: str = "MAJOR", n: int = 0) -> int:
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id=device, rule_key="r", severity=severity,
            telemetry_event_id=f"{n:064x}", reason="test", node_id="n1",
            now=await repo.db_now(conn),
        )  # fmt: skip
    assert creation.alarm is not None
    return creation.alarm.id


async def _status(pool: asyncpg.Pool, alarm_id: int) -> str:
    async with pool.acquire() as conn:
        return str(await conn.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id))


def _shifted(delta: timedelta):  # type: ignore[no-untyped-def]  # a clock factory
    async def clock(conn: asyncpg.Connection) -> datetime:
        return await repo.db_now(conn) + delta

    return clock


async def _passes_on_two_nodes(
    pool: asyncpg.Pool,
    quiet: QuietHours,
    *,
    repeat_interval_s: int,
    start: datetime,
    end: datetime,
) -> AsyncIterator[tuple[datetime, TimerReport]]:
    """The alarm timers' passes every 5 minutes from `start` to `end`, on two nodes in turn,
    each on a clock pinned to its pass's time."""
    nodes = [
        AlarmTimers(pool=pool, node_id=f"n{n}", quiet=quiet, escalate_after_s=0,
                    repeat_interval_s=repeat_interval_s)
        for n in (1, 2)
    ]  # fmt: skip
    when, step = start, 0
    while when <= end:
        timers = nodes[step % 2]
        timers.clock = _at(when)
        yield when, await timers.run_once()
        when += timedelta(minutes=5)
        step += 1


def _at(when: datetime):  # type: ignore[no-untyped-def]  # a clock factory
    async def clock(conn: asyncpg.Connection) -> datetime:
        return when

    return clock


def _window_around_now() -> QuietHoursConfig:
    now = datetime.now(UTC)
    start, end = now - timedelta(hours=1), now + timedelta(hours=1)
    return QuietHoursConfig(
        windows=[QuietWindowConfig(devices="care-*", start=start.strftime("%H:%M"),
                                   end=end.strftime("%H:%M"), timezone="UTC")]
    )  # fmt: skip


async def test_quiet_hours_delay_then_wake_and_push_and_critical_is_exempt(
    pool: asyncpg.Pool, db_dsn: str, mosquitto: Mosquitto
) -> None:
    quiet = compile_quiet_hours(_window_around_now())
    async with (
        events_subscriber(mosquitto.port),
        aiomqtt.Client("127.0.0.1", mosquitto.port) as broker,
    ):

        async def publish(topic: str, payload: bytes) -> int:
            await broker.publish(topic, payload, qos=1)
            # aiomqtt's 3.1.1 PUBACK says nothing: the MQTT 5 answer, with the person's app
            # (events_subscriber) subscribed, is 0 ("delivered to subscribers").
            return 0

        publisher = OutboxPublisher(
            pool=pool, dsn=db_dsn, node_id="n1", topics=TOPICS, publish=publish,
            metrics=Metrics(), quiet=quiet,
        )  # fmt: skip
        quiet_one = await _raise(pool, "care-1", n=1)
        critical = await _raise(pool, "care-2", severity="CRITICAL", n=2)
        elsewhere = await _raise(pool, "plant-1", n=3)
        while await publisher.run_once():
            pass
        assert await _status(pool, quiet_one) == "DELAYED"
        assert await _status(pool, critical) == "PUSHED"
        assert await _status(pool, elsewhere) == "PUSHED"

        timers = AlarmTimers(pool=pool, node_id="n1", quiet=quiet, escalate_after_s=0,
                             repeat_interval_s=0)  # fmt: skip
        assert (await timers.run_once()).woken == []  # still inside the window
        timers.clock = _shifted(timedelta(hours=3))
        assert (await timers.run_once()).woken == [quiet_one]
        assert await _status(pool, quiet_one) == "NEW"
        publisher.quiet = None  # the wake-up event is published after the window
        while await publisher.run_once():
            pass
        assert await _status(pool, quiet_one) == "PUSHED"
    async with pool.acquire() as conn:
        trail = await conn.fetch(
            "SELECT action FROM alarm_audit WHERE alarm_id = $1 ORDER BY id", quiet_one
        )
    assert [r["action"] for r in trail] == ["create", "delay", "wake", "push"]


async def test_escalation_after_the_deadline_once_even_with_two_nodes(pool: asyncpg.Pool) -> None:
    alarm_id = await _raise(pool, "d1")
    await AlarmService(pool, "n1").act(alarm_id, Action.CONFIRM, actor="alice")
    early = AlarmTimers(pool=pool, node_id="n1", quiet=None, escalate_after_s=900,
                        repeat_interval_s=0, clock=_shifted(timedelta(seconds=60)))  # fmt: skip
    assert (await early.run_once()).escalated == []
    late = [
        AlarmTimers(pool=pool, node_id=f"n{n}", quiet=None, escalate_after_s=900,
                    repeat_interval_s=0, clock=_shifted(timedelta(seconds=901)))
        for n in (1, 2)
    ]  # fmt: skip
    reports = await asyncio.gather(*(t.run_once() for t in late))
    assert sorted(r for report in reports for r in report.escalated) == [alarm_id]
    assert await _status(pool, alarm_id) == "ESCALATED"
    async with pool.acquire() as conn:
        events = await conn.fetch(
            "SELECT event_type FROM outbox_event WHERE aggregate_id = $1 ORDER BY id",
            str(alarm_id),
        )
    assert [e["event_type"] for e in events][-1] == "alarm.escalated"
    # A person handles it: nothing for the timer any more.
    await AlarmService(pool, "n1").act(alarm_id, Action.HANDLE, actor="bob")
    assert (await late[0].run_once()).escalated == []


async def test_a_pass_that_read_an_alarm_due_does_not_escalate_it_once_confirmed_again(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node B's pass has read the alarms due; before it writes, node A's pass escalates the
    alarm and bob confirms it again (ESCALATED → CONFIRMED: his clock starts now). B finds it
    CONFIRMED, as it read it, but no longer due: it does not escalate bob's confirmation. The
    clocks are `escalate_after_s` ahead, so each pass's due time is its own database time:
    alice's confirmation is due for both, bob's (after B read) is not."""
    alarm_id = await _raise(pool, "d8")
    service = AlarmService(pool, "n1")
    await service.act(alarm_id, Action.CONFIRM, actor="alice")
    node_a, node_b = (
        AlarmTimers(pool=pool, node_id=node, quiet=None, escalate_after_s=900,
                    repeat_interval_s=0, clock=_shifted(timedelta(seconds=900)))
        for node in ("A", "B")
    )  # fmt: skip
    read_due = repo.escalation_due

    async def others_act_once_b_has_read(
        conn: asyncpg.Connection, due: datetime, limit: int
    ) -> list[int]:
        ids = await read_due(conn, due, limit)
        monkeypatch.setattr(repo, "escalation_due", read_due)
        assert (await node_a.run_once()).escalated == [alarm_id]
        await service.act(alarm_id, Action.CONFIRM, actor="bob")
        return ids

    monkeypatch.setattr(repo, "escalation_due", others_act_once_b_has_read)
    assert (await node_b.run_once()).escalated == []
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT status, confirmed_by FROM alarm WHERE id = $1", alarm_id)
        trail = await conn.fetch(
            "SELECT action, actor FROM alarm_audit WHERE alarm_id = $1 ORDER BY id", alarm_id
        )
    assert tuple(row) == ("CONFIRMED", "bob")
    assert [(r["action"], r["actor"]) for r in trail] == [
        ("create", "system:rules"), ("confirm", "alice"), ("escalate", "system:escalation"),
        ("confirm", "bob"),
    ]  # fmt: skip


async def test_an_escalation_waiting_for_a_refire_escalates_and_leaves_the_new_alarm_its_key(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """The rule fires again as the escalation timer acts on the confirmed alarm: the refire's
    transaction has released the confirmed alarm's key (its status stays) and given it to the
    new alarm. The timer waits for it and escalates the alarm as the refire left it, its key
    released (not written back over the new alarm's: a unique violation ending the pass)."""
    alarm_id = await _raise(pool, "d7", n=1)
    await AlarmService(pool, "n1").act(alarm_id, Action.CONFIRM, actor="alice")
    timers = AlarmTimers(pool=pool, node_id="n1", quiet=None, escalate_after_s=900,
                         repeat_interval_s=0, clock=_shifted(timedelta(seconds=901)))  # fmt: skip
    async with pool.acquire() as ingest:
        refire = ingest.transaction()
        await refire.start()
        created = await create_alarm(
            ingest, device_id="d7", rule_key="r", severity="MAJOR",
            telemetry_event_id=f"{2:064x}", reason="refire", node_id="n2",
            now=await repo.db_now(ingest),
        )  # fmt: skip
        assert created.alarm is not None
        passing = asyncio.create_task(timers.run_once())
        await wait_until(lambda: lock_waiters(db_dsn), message="the timer waits for the refire")
        assert not passing.done()
        await refire.commit()
        report = await passing
    assert report.escalated == [alarm_id]
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT id, status, active_key FROM alarm ORDER BY id")
    assert [tuple(r) for r in rows] == [
        (alarm_id, "ESCALATED", None), (created.alarm.id, "NEW", "d7:r"),
    ]  # fmt: skip


async def test_an_alarm_quiet_hours_held_is_unreached_only_after_the_bound_from_its_wake(
    pool: asyncpg.Pool,
) -> None:
    """Held DELAYED through a night (on purpose: nobody was to be told), an alarm is NEW again
    from its wake: the pass that wakes it, long after it fired, does not find it unreached, and
    neither does one before `unreached_after_s` from the wake; the first pass after does."""
    alarm_id = await _raise(pool, "care-1", n=1)
    async with pool.acquire() as conn, conn.transaction():
        await transition(conn, alarm_id, Action.DELAY, actor=QUIET_ACTOR, node_id="n1",
                         expected=AlarmStatus.NEW)  # fmt: skip

    def timers(after: timedelta) -> AlarmTimers:
        return AlarmTimers(pool=pool, node_id="n1", quiet=None, escalate_after_s=0,
                           repeat_interval_s=0, unreached_after_s=300,
                           clock=_shifted(timedelta(hours=3) + after))  # fmt: skip

    waking = await timers(timedelta(0)).run_once()
    assert (waking.woken, waking.unreached) == ([alarm_id], [])
    assert (await timers(timedelta(seconds=299)).run_once()).unreached == []
    assert (await timers(timedelta(seconds=301)).run_once()).unreached == [alarm_id]
    assert await _status(pool, alarm_id) == "NEW"


async def test_an_alarm_kept_back_on_purpose_is_unreached_only_from_its_shelfs_end_or_never(
    pool: asyncpg.Pool,
) -> None:
    """Shelved, an alarm notifies nobody on purpose: no pass finds it unreached while the
    shelf stands, and once it is lifted, only `unreached_after_s` after. One raised while its
    device was out of service notifies nobody by design: never unreached. Another is, as any."""
    shelved = await _raise(pool, "d-shelved", n=1)
    plain = await _raise(pool, "d-plain", n=2)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('d-away', now(), now())"
        )
        await set_out_of_service(
            conn, "d-away", reason="pump swap", until=None, actor="carol", request_id=None
        )
        shelf = await shelve(
            conn, scope="alarm", alarm_id=shelved, device_id=None, rule_key=None,
            seconds=3600, reason="known", actor="carol", node_id="n1", request_id=None,
        )  # fmt: skip
    away = await _raise(pool, "d-away", n=3)

    def timers(after: timedelta) -> AlarmTimers:
        return AlarmTimers(pool=pool, node_id="n1", quiet=None, escalate_after_s=0,
                           repeat_interval_s=0, unreached_after_s=300,
                           clock=_shifted(after))  # fmt: skip

    assert (await timers(timedelta(seconds=301)).run_once()).unreached == [plain]
    assert (await timers(timedelta(seconds=1000)).run_once()).unreached == []
    async with pool.acquire() as conn, conn.transaction():
        await lift(conn, shelf["id"], actor="carol", node_id="n1", request_id=None)
    assert (await timers(timedelta(seconds=299)).run_once()).unreached == []
    assert (await timers(timedelta(seconds=301)).run_once()).unreached == [shelved]
    assert (await timers(timedelta(days=2)).run_once()).unreached == []  # `away`: never
    assert [await _status(pool, a) for a in (shelved, plain, away)] == ["NEW"] * 3


async def test_reminders_renotify_without_changing_state(pool: asyncpg.Pool) -> None:
    alarm_id = await _raise(pool, "d2")
    async with pool.acquire() as conn, conn.transaction():
        await transition(conn, alarm_id, Action.PUSH, actor="system:test", node_id="n1")

    def timers(minutes: int) -> AlarmTimers:
        clock = _shifted(timedelta(minutes=minutes))
        return AlarmTimers(
            pool=pool, node_id="n1", quiet=None, escalate_after_s=0, repeat_interval_s=600,
            clock=clock,
        )  # fmt: skip

    assert (await timers(5).run_once()).reminded == []
    assert (await timers(11).run_once()).reminded == [alarm_id]
    assert (await timers(11).run_once()).reminded == []  # reminded already at that time
    assert (await timers(22).run_once()).reminded == [alarm_id]
    assert await _status(pool, alarm_id) == "PUSHED"
    await AlarmService(pool, "n1").act(alarm_id, Action.CONFIRM, actor="carol")
    assert (await timers(60).run_once()).reminded == []  # confirmed: no more reminders
    async with pool.acquire() as conn:
        count = await conn.fetchval(
            "SELECT count(*) FROM outbox_event WHERE event_type = 'alarm.reminder'"
        )
    assert count == 2
    assert AlarmStatus.CONFIRMED.value == await _status(pool, alarm_id)


async def test_a_long_quiet_window_yields_one_reminder_per_alarm_at_its_end(
    pool: asyncpg.Pool,
) -> None:
    """22:00-07:00 with reminders every 10 minutes, passes every 10 minutes through the night
    on two nodes in turn: inside the window no reminder is made; at 07:00 one per alarm
    (before, ~54 each fell due together at 07:00)."""
    night = compile_quiet_hours(QuietHoursConfig(
        windows=[QuietWindowConfig(start="22:00", end="07:00", timezone="UTC")]
    ))  # fmt: skip
    evening = datetime(2030, 1, 7, 21, 50, tzinfo=UTC)
    alarms = []
    for n, device in enumerate(("care-1", "care-2")):
        async with pool.acquire() as conn, conn.transaction():
            creation = await create_alarm(
                conn, device_id=device, rule_key="r", severity="MAJOR",
                telemetry_event_id=f"{n + 10:064x}", reason="test", node_id="n1", now=evening,
            )  # fmt: skip
            assert creation.alarm is not None
            # Pushed before the window: ringing, unconfirmed, and due a reminder every 10 min.
            await transition(conn, creation.alarm.id, Action.PUSH, actor="system:test",
                             node_id="n1", now=evening)  # fmt: skip
        alarms.append(creation.alarm.id)

    reminded: dict[datetime, list[int]] = {}
    passes = _passes_on_two_nodes(
        pool, night, repeat_interval_s=600, start=evening,
        end=datetime(2030, 1, 8, 7, 5, tzinfo=UTC),
    )  # fmt: skip
    async for when, report in passes:
        if report.reminded:
            reminded[when] = sorted(report.reminded)
    assert reminded == {datetime(2030, 1, 8, 7, 0, tzinfo=UTC): sorted(alarms)}
    async with pool.acquire() as conn:
        count = await conn.fetchval(
            "SELECT count(*) FROM outbox_event WHERE event_type = 'alarm.reminder'"
        )
    assert count == len(alarms)


async def test_a_held_alarms_notification_goes_out_on_its_wake_and_pushes_it(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """A reload reaching the nodes one by one: one node holds the alarm DELAYED (it has the
    window) while another node's notify consumer (still without it) reads its event. The
    notification follows the alarm, not the reading node's quiet hours: held while the alarm
    is DELAYED, nobody told; the wake releases it, and the receiver accepting it pushes the
    alarm, so it does not stay NEW with someone told."""
    async with webhook_server() as hook:
        config = parse_config(
            "[notify]\npoll_s = 0.1\nbackoff_min_s = 0.05\nbackoff_max_s = 0.2\n"
            f'[[notify.receivers]]\nname = "hook"\nkind = "webhook"\nurl = "{hook.url("/hook")}"\n'
            '[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["hook"]\n'
        )
        alarm_id = await _raise(pool, "care-7")
        async with pool.acquire() as conn, conn.transaction():
            await transition(conn, alarm_id, Action.DELAY, actor=QUIET_ACTOR, node_id="n1",
                             expected=AlarmStatus.NEW)  # fmt: skip
        metrics = NotifyMetrics(Metrics().registry)
        rules = config.notify_rules()
        worker = DeliveryWorker(
            pool=pool, node_id="n2", metrics=metrics, settings=config.notify, rules=rules
        )
        consumer = NotifyConsumer(pool=pool, dsn=db_dsn, metrics=metrics, rules=rules,
                                  public_url="", quiet=None, batch=10)  # fmt: skip
        while await consumer.run_once():
            pass
        # Held: no claim takes it while the alarm is DELAYED.
        assert await worker.run_once() == 0
        assert hook.on("/hook") == []
        assert await _status(pool, alarm_id) == "DELAYED"

        timers = AlarmTimers(pool=pool, node_id="n1", quiet=None, escalate_after_s=0,
                             repeat_interval_s=0)  # fmt: skip
        report = await timers.run_once()
        assert (report.woken, report.released) == ([alarm_id], 1)
        stop = asyncio.Event()
        sending = asyncio.create_task(worker.run(stop))
        try:

            async def pushed() -> bool:
                return await _status(pool, alarm_id) == "PUSHED"

            await wait_until(pushed, timeout=30, message="the released notification pushed it")
        finally:
            stop.set()
            await sending
            await worker.close()
        assert len(hook.on("/hook")) == 1
        async with pool.acquire() as conn:
            note = await conn.fetchval(
                "SELECT note FROM alarm_audit WHERE alarm_id = $1 AND action = 'push'", alarm_id
            )
            delivery_id = await conn.fetchval(
                "SELECT id FROM notify_delivery WHERE alarm_id = $1", alarm_id
            )
        assert note == f"reached via webhook receiver hook (delivery {delivery_id})"


async def test_a_held_notification_of_an_alarm_shelved_in_the_night_is_suppressed_at_its_wake(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """Two alarms held DELAYED by the night, their notifications held with them; an operator
    shelves one. At the end of the window the wake makes the other's notification due (sent,
    it pushes its alarm) and records the shelved one's SUPPRESSED, naming the shelf, as the
    consumer records a notification of a shelved alarm: never sent, it pushes nothing."""
    async with webhook_server() as hook:
        config = parse_config(
            "[notify]\npoll_s = 0.1\nbackoff_min_s = 0.05\nbackoff_max_s = 0.2\n"
            f'[[notify.receivers]]\nname = "hook"\nkind = "webhook"\nurl = "{hook.url("/hook")}"\n'
            '[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["hook"]\n'
        )
        shelved, loud = await _raise(pool, "care-7", n=1), await _raise(pool, "care-8", n=2)
        async with pool.acquire() as conn, conn.transaction():
            for alarm_id in (shelved, loud):
                await transition(conn, alarm_id, Action.DELAY, actor=QUIET_ACTOR, node_id="n1",
                                 expected=AlarmStatus.NEW)  # fmt: skip
        metrics = NotifyMetrics(Metrics().registry)
        rules = config.notify_rules()
        consumer = NotifyConsumer(pool=pool, dsn=db_dsn, metrics=metrics, rules=rules,
                                  public_url="", quiet=None, batch=10)  # fmt: skip
        while await consumer.run_once():
            pass
        service = AlarmService(pool, "n1", shelve_max_s=86400)
        await service.shelve(scope="alarm", alarm_id=shelved, device_id=None, rule_key=None,
                             seconds=3600, reason="known sensor fault", actor="alice")  # fmt: skip
        suppressed_for: list[str] = []
        timers = AlarmTimers(
            pool=pool, node_id="n1", quiet=None, escalate_after_s=0, repeat_interval_s=0,
            count_suppressed=suppressed_for.append,
        )  # fmt: skip
        report = await timers.run_once()
        assert (sorted(report.woken), report.released, report.suppressed) == (
            sorted([shelved, loud]), 1, 1,
        )  # fmt: skip
        assert suppressed_for == ["hook"]
        worker = DeliveryWorker(
            pool=pool, node_id="n2", metrics=metrics, settings=config.notify, rules=rules
        )
        stop = asyncio.Event()
        sending = asyncio.create_task(worker.run(stop))
        try:

            async def all_final() -> bool:
                async with pool.acquire() as conn:
                    return not await conn.fetchval(
                        "SELECT count(*) FROM notify_delivery"
                        " WHERE status IN ('PENDING', 'SENDING')"
                    )

            await wait_until(all_final, timeout=30, message="every delivery sent or suppressed")
        finally:
            stop.set()
            await sending
            await worker.close()
        async with pool.acquire() as conn:
            rows = {
                r["alarm_id"]: (r["status"], r["suppressed"])
                for r in await conn.fetch("SELECT * FROM notify_delivery")
            }
            shelf_id = await conn.fetchval("SELECT id FROM alarm_shelf")
        assert rows == {
            shelved: ("SUPPRESSED", f"shelved (shelf {shelf_id})"),
            loud: ("SENT", None),
        }
        assert [r.json["alarm_id"] for r in hook.on("/hook")] == [loud]
        assert (await _status(pool, shelved), await _status(pool, loud)) == ("NEW", "PUSHED")


async def test_quiet_hours_are_decided_once_per_alarm_by_whichever_reaches_it_first(
    pool: asyncpg.Pool, db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Nodes that disagree on the quiet hours (a reload reaching them one by one). Whoever
    reaches the new alarm first decides, and the other follows the stored decision: the
    consumer of a node without the window made the alarm's notification first, so the
    publisher of a node with it does not hold the alarm (its notification may be on its way
    to a person); the consumer of a node with the window held the other alarm first, so the
    publisher of a node without it leaves it DELAYED, and its notification waits for the
    wake."""
    quiet = compile_quiet_hours(_window_around_now())
    config = parse_config(
        '[[notify.receivers]]\nname = "hook"\nkind = "webhook"\nurl = "http://127.0.0.1:9/h"\n'
        '[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["hook"]\n'
    )
    rules = config.notify_rules()
    metrics = NotifyMetrics(Metrics().registry)

    def consumer(window: object) -> NotifyConsumer:
        return NotifyConsumer(pool=pool, dsn=db_dsn, metrics=metrics, rules=rules,
                              quiet=quiet if window else None, node_id="n2")  # fmt: skip

    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as broker:

        async def publish(topic: str, payload: bytes) -> int:
            await broker.publish(topic, payload, qos=1)
            return 0x10  # no subscribers: a publish pushes nothing

        def publisher(window: object) -> OutboxPublisher:
            return OutboxPublisher(pool=pool, dsn=db_dsn, node_id="n1", topics=TOPICS,
                                   publish=publish, metrics=Metrics(),
                                   quiet=quiet if window else None)  # fmt: skip

        told = await _raise(pool, "care-1", n=1)
        while await consumer(window=False).run_once():
            pass
        while await publisher(window=True).run_once():
            pass
        assert await _status(pool, told) == "NEW"  # not held: its notification is due
        async with pool.acquire() as conn:
            [due] = await conn.fetch(
                "SELECT next_attempt_at <= now() AS due FROM notify_delivery WHERE alarm_id = $1",
                told,
            )
        assert due["due"]

        held = await _raise(pool, "care-2", n=2)
        while await consumer(window=True).run_once():
            pass
        assert await _status(pool, held) == "DELAYED"
        while await publisher(window=False).run_once():
            pass
        assert await _status(pool, held) == "DELAYED"  # the stored decision stands
    async with pool.acquire() as conn:
        trail = await conn.fetch(
            "SELECT alarm_id, action, actor FROM alarm_audit WHERE action = 'delay' ORDER BY id"
        )
    assert [(r["alarm_id"], r["actor"]) for r in trail] == [(held, QUIET_ACTOR)]


@pytest.mark.parametrize(
    ("end", "zone", "evening", "wake"),
    [
        # Berlin, the night the clocks go back (03:00 CEST -> 02:00 CET): 07:00 is 06:00 UTC.
        ("07:00", "Europe/Berlin", datetime(2030, 10, 26, 20, 30, tzinfo=UTC),
         datetime(2030, 10, 27, 6, 0, tzinfo=UTC)),
        # An end inside the hour that repeats: its last pass, 02:30 CET.
        ("02:30", "Europe/Berlin", datetime(2030, 10, 26, 20, 30, tzinfo=UTC),
         datetime(2030, 10, 27, 1, 30, tzinfo=UTC)),
        # The night they go forward (02:00 CET -> 03:00 CEST): 07:00 is 05:00 UTC.
        ("07:00", "Europe/Berlin", datetime(2030, 3, 30, 21, 30, tzinfo=UTC),
         datetime(2030, 3, 31, 5, 0, tzinfo=UTC)),
        # An end inside the hour that is skipped: when the gap ends, 03:00 CEST.
        ("02:30", "Europe/Berlin", datetime(2030, 3, 30, 21, 30, tzinfo=UTC),
         datetime(2030, 3, 31, 1, 0, tzinfo=UTC)),
        # Lord Howe goes back half an hour (02:00 +11:00 -> 01:30 +10:30): 07:00 is 20:30 UTC.
        ("07:00", "Australia/Lord_Howe", datetime(2030, 4, 6, 11, 30, tzinfo=UTC),
         datetime(2030, 4, 6, 20, 30, tzinfo=UTC)),
    ],
)  # fmt: skip
async def test_a_night_held_alarm_wakes_once_at_the_real_end_of_quiet_hours_across_dst(
    pool: asyncpg.Pool, end: str, zone: str, evening: datetime, wake: datetime
) -> None:
    """22:00-07:00 (or -02:30) local on a night the clocks change: an alarm held at 22:30
    wakes at the first pass at or after the window's end, once, never an hour (or half an
    hour) early or late, with passes every 5 minutes on two nodes in turn; the wake the
    consumer expects for its held notifications (quiet_until) is that instant too."""
    night = compile_quiet_hours(QuietHoursConfig(
        windows=[QuietWindowConfig(start="22:00", end=end, timezone=zone)]
    ))  # fmt: skip
    assert night.quiet_until(device_id="care-1", severity="MAJOR", at=evening) == wake
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id="care-1", rule_key="r", severity="MAJOR",
            telemetry_event_id=f"{1:064x}", reason="test", node_id="n1", now=evening,
        )  # fmt: skip
        assert creation.alarm is not None
        alarm_id = creation.alarm.id
        assert await hold(conn, alarm_id, quiet=night, node_id="n1", now=evening)

    passes = _passes_on_two_nodes(
        pool, night, repeat_interval_s=0, start=evening, end=wake + timedelta(hours=2)
    )
    woken = [when async for when, report in passes if report.woken]
    assert woken == [wake]
    assert await _status(pool, alarm_id) == "NEW"
