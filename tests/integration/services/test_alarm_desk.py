"""The alarm desk against a real PostgreSQL (docs/behaviour.md §5, "States people can read",
"Shelving", "Out of service"): filters, counts, groups, bulk actions, shelves and their expiry
by two nodes' timers racing, out of service, and notifications suppressed for a shelved alarm
with a real route and a real webhook receiver."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import asyncpg
import pytest

from gateway.alarms.lifecycle import clear_alarm, create_alarm
from gateway.alarms.service import AlarmService, Filters, TooManyAlarmsError
from gateway.alarms.shelving import (
    AlreadyShelvedError,
    NotOutOfServiceError,
    ShelfEndedError,
    ShelfTooLongError,
    UntilPastError,
)
from gateway.alarms.timers import AlarmTimers
from gateway.config import parse_config
from gateway.domain.alarm import Action, IllegalTransitionError
from gateway.notify.consumer import NotifyConsumer
from gateway.notify.metrics import NotifyMetrics
from gateway.notify.worker import DeliveryWorker
from gateway.support.metrics import Metrics
from storage.alarms import db_now
from storage.pool import create_pool
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

NOTIFY = """
[notify]
max_attempts = 3
backoff_min_s = 0.01
backoff_max_s = 0.05
poll_s = 0.05
lease_s = 30
"""


async def _raise(
    db: asyncpg.Connection, device: str, rule: str = "hot", severity: str = "MAJOR"
) -> int:
    async with db.transaction():
        created = await create_alarm(
            db, device_id=device, rule_key=rule, severity=severity,
            telemetry_event_id=uuid.uuid4().hex, reason="test", node_id="n",
            now=await db_now(db),
        )  # fmt: skip
    assert created.alarm is not None
    return created.alarm.id


async def _clear(db: asyncpg.Connection, device: str, rule: str = "hot") -> None:
    async with db.transaction():
        cleared = await clear_alarm(
            db, device_id=device, rule_key=rule, clear_event_id=uuid.uuid4().hex,
            reason="back to normal", now=await db_now(db),
        )  # fmt: skip
    assert cleared is not None


async def _device(db: asyncpg.Connection, device: str) -> None:
    await db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES ($1, now(), now())", device
    )


async def _audit(db: asyncpg.Connection, alarm_id: int, action: str) -> list[asyncpg.Record]:
    return list(
        await db.fetch(
            "SELECT * FROM alarm_audit WHERE alarm_id = $1 AND action = $2 ORDER BY id",
            alarm_id,
            action,
        )
    )


@pytest.fixture
def service(pool: asyncpg.Pool) -> AlarmService:
    return AlarmService(pool, "n1", shelve_max_s=3600.0, bulk_max=5)


def _ids(views: list) -> list[int]:  # type: ignore[type-arg]
    return [v.alarm.id for v in views]


async def test_filters_split_active_from_returned_to_normal_and_acknowledged(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    live = await _raise(db, "d1")
    back = await _raise(db, "d2")
    await _clear(db, "d2")
    taken = await _raise(db, "d3")
    await _clear(db, "d3")
    await service.act(taken, Action.CONFIRM, actor="alice")
    closed = await _raise(db, "d4")
    await service.act(closed, Action.HANDLE, actor="alice")
    await service.act(closed, Action.CLOSE, actor="alice")

    assert _ids(await service.views(Filters(active=True))) == [closed, live]
    assert _ids(await service.views(Filters(cleared=True))) == [taken, back]
    assert _ids(await service.views(Filters(cleared=True, acknowledged=False))) == [back]
    assert _ids(await service.views(Filters(cleared=True, acknowledged=True))) == [taken]
    assert _ids(await service.views(Filters(active=True, open_only=True))) == [live]
    # Contradictions select nothing, rather than being read as "no filter".
    assert await service.views(Filters(active=True, cleared=True)) == []
    assert _ids(await service.views(Filters(severity="CRITICAL"))) == []


async def test_counts_put_each_open_alarm_in_one_bucket_per_severity(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    await _raise(db, "d1", severity="CRITICAL")  # active, unacknowledged
    await _raise(db, "d2", severity="CRITICAL")
    await _clear(db, "d2")  # returned to normal, unacknowledged
    acked = await _raise(db, "d3", severity="CRITICAL")
    await service.act(acked, Action.CONFIRM, actor="alice")  # active, acknowledged
    shelved = await _raise(db, "d4", severity="MAJOR")
    await service.shelve(scope="alarm", alarm_id=shelved, device_id=None, rule_key=None,
                         seconds=600, reason="known fault", actor="alice")  # fmt: skip
    gone = await _raise(db, "d5", severity="MAJOR")
    await service.act(gone, Action.FALSE, actor="alice")  # not open: not counted

    rows = {r["severity"]: r for r in await service.counts()}
    assert set(rows) == {"CRITICAL", "MAJOR"}
    critical = rows["CRITICAL"]
    assert (critical["total"], critical["active_unacknowledged"], critical["active_acknowledged"],
            critical["returned_unacknowledged"], critical["returned_acknowledged"],
            critical["shelved"]) == (3, 1, 1, 1, 0, 0)  # fmt: skip
    assert (rows["MAJOR"]["total"], rows["MAJOR"]["shelved"]) == (1, 1)
    # One pass over a partial index of the open alarms (a table this small is scanned whole
    # unless told otherwise: the planner must be able to use one).
    async with db.transaction():
        await db.execute("SET LOCAL enable_seqscan = off")
        plan = await db.fetch("EXPLAIN " + _counts_sql())
    lines = [r[0] for r in plan]
    # A partial index of the open alarms (alarm_open_id_idx, or another on the same statuses).
    assert not any("Seq Scan on alarm " in line for line in lines), lines
    assert any("alarm_open_" in line for line in lines), lines


def _counts_sql() -> str:
    from storage.sql import load_queries

    return load_queries("desk.sql")["counts"]


async def test_groups_by_rule_and_device_count_newest_and_worst(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    await _raise(db, "a", "hot", "WARNING")
    newest_hot = await _raise(db, "b", "hot", "CRITICAL")
    await _raise(db, "a", "cold", "INFO")
    by_rule = await service.groups(Filters(open_only=True), by="rule", limit=10)
    assert [(g["key"], g["count"], g["newest_id"], g["worst"]) for g in by_rule] == [
        ("hot", 2, newest_hot, 4),
        ("cold", 1, newest_hot + 1, 1),
    ]
    by_device = await service.groups(Filters(open_only=True), by="device", limit=10)
    assert {g["key"]: g["count"] for g in by_device} == {"a": 2, "b": 1}
    assert await service.group_ids(Filters(open_only=True), by="rule", key="hot") == [
        newest_hot,
        newest_hot - 1,
    ]


async def test_bulk_acts_on_each_alarm_alone_and_one_refused_stops_nothing(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    first = await _raise(db, "d1")
    handled = await _raise(db, "d2")
    await service.act(handled, Action.HANDLE, actor="bob")
    third = await _raise(db, "d3")
    audit_before = await db.fetchval("SELECT count(*) FROM alarm_audit")

    results = await service.bulk(
        Action.CONFIRM, [first, handled, third, 999_999], actor="alice", note="storm"
    )
    assert [r.alarm_id for r in results] == [first, handled, third, 999_999]
    assert [r.alarm is not None and r.alarm.status.value for r in results[::2]] == [
        "CONFIRMED",
        "CONFIRMED",
    ]
    assert isinstance(results[1].error, IllegalTransitionError)
    assert results[3].error is not None
    assert results[3].error.code == "NOT_FOUND"
    # One audit row per alarm acted on, none for the refused ones.
    assert await db.fetchval("SELECT count(*) FROM alarm_audit") == audit_before + 2
    for alarm_id in (first, third):
        [row] = await _audit(db, alarm_id, "confirm")
        assert (row["actor"], row["note"]) == ("alice", "storm")
    assert (await service.view(handled)).alarm.status.value == "HANDLED"

    with pytest.raises(TooManyAlarmsError):
        await service.bulk(Action.CONFIRM, list(range(1, 7)), actor="alice")
    for n in range(6):
        await _raise(db, f"many-{n}", rule="many")
    with pytest.raises(TooManyAlarmsError):
        await service.group_ids(Filters(open_only=True), by="rule", key="many")


async def test_a_shelved_alarm_leaves_the_default_view_and_is_audited(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    alarm_id = await _raise(db, "d1")
    other = await _raise(db, "d2")
    shelf = await service.shelve(scope="alarm", alarm_id=alarm_id, device_id=None,
                                 rule_key=None, seconds=600, reason="sensor swap",
                                 actor="alice", request_id="r1")  # fmt: skip
    assert _ids(await service.views(Filters())) == [other]
    assert _ids(await service.views(Filters(shelved="only"))) == [alarm_id]
    assert _ids(await service.views(Filters(shelved="any"))) == [other, alarm_id]
    view = await service.view(alarm_id)
    assert view.shelved_until == shelf["until"]
    [row] = await _audit(db, alarm_id, "shelve")
    assert (row["actor"], row["request_id"], row["from_status"], row["to_status"]) == (
        "alice", "r1", "NEW", "NEW",
    )  # fmt: skip
    assert "sensor swap" in row["note"]

    with pytest.raises(AlreadyShelvedError):
        await service.shelve(scope="alarm", alarm_id=alarm_id, device_id=None, rule_key=None,
                             seconds=60, reason="again", actor="bob")  # fmt: skip
    with pytest.raises(ShelfTooLongError):
        await service.shelve(scope="alarm", alarm_id=other, device_id=None, rule_key=None,
                             seconds=3601, reason="too long", actor="bob")  # fmt: skip
    assert await db.fetchval("SELECT count(*) FROM alarm_shelf") == 1

    lifted = await service.lift(shelf["id"], actor="bob")
    assert (lifted["end_reason"], lifted["ended_by"]) == ("lifted", "bob")
    assert (await service.view(alarm_id)).shelved_until is None
    assert _ids(await service.views(Filters())) == [other, alarm_id]
    [row] = await _audit(db, alarm_id, "unshelve")
    assert row["actor"] == "bob"
    with pytest.raises(ShelfEndedError):
        await service.lift(shelf["id"], actor="bob")


async def test_new_alarms_of_a_shelved_pair_are_created_shelved(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    before = await _raise(db, "pump", "hot")
    await service.shelve(scope="pair", alarm_id=None, device_id="pump", rule_key="hot",
                         seconds=600, reason="maintenance", actor="alice")  # fmt: skip
    assert len(await _audit(db, before, "shelve")) == 1
    after = await _raise(db, "pump", "hot")  # supersedes `before`
    elsewhere = await _raise(db, "fan", "hot")
    shelved = await service.views(Filters(shelved="only"))
    assert _ids(shelved) == [after, before]
    assert _ids(await service.views(Filters())) == [elsewhere]


async def test_two_nodes_timers_racing_end_an_expired_shelf_once(
    db_dsn: str, service: AlarmService, db: asyncpg.Connection
) -> None:
    alarm_id = await _raise(db, "d1")
    shelf = await service.shelve(
        scope="alarm", alarm_id=alarm_id, device_id=None, rule_key=None, seconds=0.2,
        reason="brief", actor="alice",
    )  # fmt: skip
    # Both nodes' clocks are past the shelf's end: each pass would end it.
    later = shelf["until"] + timedelta(seconds=1)

    async def clock(_conn: asyncpg.Connection):  # type: ignore[no-untyped-def]
        return later

    await wait_until(
        lambda: _db_past(db, shelf["until"]), message="the database clock passes the until"
    )
    pools = [await create_pool(db_dsn, min_size=1, max_size=2) for _ in range(2)]
    try:
        timers = [
            AlarmTimers(pool=p, node_id=f"node-{n}", quiet=None, escalate_after_s=0,
                        repeat_interval_s=0, unreached_after_s=0, clock=clock)
            for n, p in enumerate(pools)
        ]  # fmt: skip
        reports = await asyncio.gather(*(t.run_once() for t in timers))
    finally:
        for p in pools:
            await p.close()
    assert sorted(r.unshelved for r in reports) == [[], [shelf["id"]]]
    ended = await db.fetchrow("SELECT * FROM alarm_shelf WHERE id = $1", shelf["id"])
    assert (ended["end_reason"], ended["ended_by"], ended["ended_at"]) == (
        "expired", "system:shelving", shelf["until"],
    )  # fmt: skip
    [row] = await _audit(db, alarm_id, "unshelve")
    assert row["actor"] == "system:shelving"
    assert (await service.view(alarm_id)).shelved_until is None
    # Shelving it again works: nothing is left in the way.
    await service.shelve(scope="alarm", alarm_id=alarm_id, device_id=None, rule_key=None,
                         seconds=60, reason="again", actor="alice")  # fmt: skip


async def _db_past(db: asyncpg.Connection, at: object) -> bool:
    return bool(await db.fetchval("SELECT now() > $1", at))


async def test_out_of_service_marks_new_alarms_and_ends(
    service: AlarmService, db: asyncpg.Connection
) -> None:
    await _device(db, "d1")
    before = await _raise(db, "d1", "a")
    period = await service.set_out_of_service("d1", reason="calibration", until=None,
                                              actor="alice")  # fmt: skip
    assert (await service.out_of_service("d1"))["id"] == period["id"]
    during = await _raise(db, "d1", "b")
    assert (await service.view(before)).out_of_service is False
    assert (await service.view(during)).out_of_service is True
    ended = await service.end_out_of_service("d1", actor="bob")
    assert ended["ended_by"] == "bob"
    after = await _raise(db, "d1", "c")
    assert (await service.view(after)).out_of_service is False
    assert (await service.view(during)).out_of_service is True  # raised in the period
    assert await service.out_of_service("d1") is None
    with pytest.raises(NotOutOfServiceError):
        await service.end_out_of_service("d1", actor="bob")
    past = (await db_now(db)) - timedelta(minutes=1)
    with pytest.raises(UntilPastError):
        await service.set_out_of_service("d1", reason="x", until=past, actor="alice")
    assert await db.fetchval("SELECT count(*) FROM device_out_of_service") == 1


async def test_no_notification_is_sent_for_a_shelved_alarm_or_one_out_of_service(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection, service: AlarmService
) -> None:
    """A real route and a real webhook receiver: the shelved pair's new alarm and the alarm of a
    device out of service get SUPPRESSED deliveries (visible, never sent); another alarm is
    sent; when the shelf is lifted, the shelved alarm, still open, is sent once (returned from
    the shelf), and the pair's next alarm is sent again."""
    await _device(db, "maint")
    await service.shelve(scope="pair", alarm_id=None, device_id="pump", rule_key="hot",
                         seconds=600, reason="known", actor="alice")  # fmt: skip
    await service.set_out_of_service("maint", reason="work", until=None, actor="alice")
    async with webhook_server() as server:
        url = server.url("/hook")
        config = parse_config(
            NOTIFY
            + f'[[notify.receivers]]\nname = "hook"\nkind = "webhook"\nurl = "{url}"\n'
            + '[[notify.routes]]\nreceivers = ["hook"]\n'
        )
        rules = config.notify_rules()
        metrics = NotifyMetrics(Metrics().registry)
        worker = DeliveryWorker(pool=pool, node_id="n1", metrics=metrics,
                                settings=config.notify, rules=rules)  # fmt: skip
        consumer = NotifyConsumer(pool=pool, dsn=db_dsn, metrics=metrics, rules=rules,
                                  batch=config.notify.batch)  # fmt: skip
        shelved = await _raise(db, "pump", "hot")
        maint = await _raise(db, "maint", "hot")
        loud = await _raise(db, "fan", "hot")
        while await consumer.run_once():
            pass
        [shelf] = await service.shelves(in_force=True, before_id=None, limit=10)
        await service.lift(shelf["id"], actor="alice")
        again = await _raise(db, "pump", "hot")
        while await consumer.run_once():
            pass
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            await wait_until(lambda: _all_final(db), message="every delivery sent or suppressed")
        finally:
            stop.set()
            await task
        every = await db.fetch("SELECT * FROM notify_delivery ORDER BY id")
        rows = {r["alarm_id"]: r for r in every if "returned_from_shelf" not in r["body"]}
        [returned] = [r for r in every if "returned_from_shelf" in r["body"]]
        assert (returned["alarm_id"], returned["status"]) == (shelved, "SENT")
        assert (rows[shelved]["status"], rows[shelved]["suppressed"]) == (
            "SUPPRESSED", f"shelved (shelf {shelf['id']})",
        )  # fmt: skip
        assert (rows[maint]["status"], rows[maint]["suppressed"]) == (
            "SUPPRESSED", "out of service",
        )  # fmt: skip
        assert rows[loud]["status"] == "SENT"
        assert rows[again]["status"] == "SENT"
        sent = {r.json["alarm_id"] for r in server.on("/hook")}
        assert sent == {loud, again, shelved}
        assert metrics.deliveries.labels("hook", "SUPPRESSED")._value.get() == 2
        # A suppressed notification pushes nothing: the alarm stays NEW.
        assert (await service.view(maint)).alarm.status.value == "NEW"


async def _all_final(db: asyncpg.Connection) -> bool:
    return not await db.fetchval(
        "SELECT count(*) FROM notify_delivery WHERE status IN ('PENDING', 'SENDING')"
    )


async def test_a_shelf_ends_at_its_until_exactly_once_not_a_microsecond_before(
    db_dsn: str, service: AlarmService, db: asyncpg.Connection
) -> None:
    """Two nodes' timer passes with clocks injected: one a microsecond before the shelf's
    until ends nothing; at the until itself both race and one ends it, at it; a pass after
    finds nothing more to end. (The until is an instant: a person's local offset, across a
    DST change or not, names the same one.)"""
    alarm_id = await _raise(db, "d1")
    shelf = await service.shelve(
        scope="alarm", alarm_id=alarm_id, device_id=None, rule_key=None, seconds=3600,
        reason="night", actor="alice",
    )  # fmt: skip
    until = shelf["until"]
    pools = [await create_pool(db_dsn, min_size=1, max_size=2) for _ in range(2)]
    try:

        def timers(at: object) -> list[AlarmTimers]:
            async def clock(_conn: asyncpg.Connection):  # type: ignore[no-untyped-def]
                return at

            return [
                AlarmTimers(pool=p, node_id=f"node-{n}", quiet=None, escalate_after_s=0,
                            repeat_interval_s=0, unreached_after_s=0, clock=clock)
                for n, p in enumerate(pools)
            ]  # fmt: skip

        async def passes(at: object) -> list[list[int]]:
            reports = await asyncio.gather(*(t.run_once() for t in timers(at)))
            return sorted(r.unshelved for r in reports)

        assert await passes(until - timedelta(microseconds=1)) == [[], []]
        assert (
            await db.fetchval("SELECT ended_at FROM alarm_shelf WHERE id = $1", shelf["id"]) is None
        )
        assert await passes(until) == [[], [shelf["id"]]]
        assert await passes(until + timedelta(seconds=1)) == [[], []]
    finally:
        for p in pools:
            await p.close()
    ended = await db.fetchrow("SELECT * FROM alarm_shelf WHERE id = $1", shelf["id"])
    assert (ended["end_reason"], ended["ended_at"]) == ("expired", until)
    assert len(await _audit(db, alarm_id, "unshelve")) == 1
