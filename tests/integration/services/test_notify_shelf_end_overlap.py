"""Two shelves over one alarm (its own shelf and its pair's) ending at once on two nodes or by
two people: the alarm returns to annunciation when the last of them ends, so each ungrouped
receiver is told once, never twice, and never by nobody (docs/notifications.md, "A shelf's end
tells its alarms again"). Real PostgreSQL, real webhook receivers, two nodes; the interleaving
is forced by holding one end's transaction open while the other runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import asyncpg

from gateway.alarms.lifecycle import transition
from gateway.alarms.shelving import expire_due, lift
from gateway.domain.alarm import Action
from protocol.events import EventType
from storage import alarms as alarm_repo
from tests.integration.services.test_notify_shelf_end import (
    ROUTES,
    _config,
    _consume_together,
    _deliveries,
    _got,
    _past_its_until,
    _quiet_now,
    _raise,
    _returns,
    _shelve_alarm,
    _shelve_pair,
    _status,
    _timers,
    _two_nodes,
    _waiting_on_a_lock,
)
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

End = Callable[[asyncpg.Connection], Awaitable[object]]


async def _ends_at_once(db_dsn: str, db: asyncpg.Connection, first: End, second: End) -> None:
    """`first` ends its shelf in a transaction held open while `second` ends the other in its
    own (and commits, or waits for the first); then the first commits."""
    one = await asyncpg.connect(db_dsn)
    two = await asyncpg.connect(db_dsn)
    try:
        held = one.transaction()
        await held.start()
        await first(one)

        async def other() -> None:
            async with two.transaction():
                await second(two)

        racing = asyncio.create_task(other())
        await wait_until(
            lambda: racing.done() or _waiting_on_a_lock(db),
            message="the second end is done, or waits for the first",
        )
        await held.commit()
        await racing
    finally:
        await one.close()
        await two.close()


async def test_an_alarm_under_its_shelf_and_its_pairs_both_lifted_at_once_is_told_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """An alarm raised under its pair's shelf, then shelved itself too; two operators lift the
    two shelves at the same moment. Each end sees the other shelf still in force (not yet
    committed), so neither told anybody: the alarm stood, unshelved, and no ungrouped receiver
    ever heard of it. Now each ungrouped receiver gets it once."""
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        pair = await _shelve_pair(db, "pump-20")
        alarm_id = await _raise(db, "pump-20")
        own = await _shelve_alarm(db, alarm_id)
        await _consume_together(nodes)
        assert {d["status"] for d in await _deliveries(db, alarm_id)} == {"SUPPRESSED"}

        async def lift_own(conn: asyncpg.Connection) -> None:
            await lift(conn, own, actor="op-a", node_id="n1", request_id=None)

        async def lift_pair(conn: asyncpg.Connection) -> None:
            await lift(conn, pair, actor="op-b", node_id="n2", request_id=None)

        await _ends_at_once(db_dsn, db, lift_own, lift_pair)
        returns = await _returns(db, alarm_id)
        assert sorted(d["receiver"] for d in returns) == ["each", "hook"]


async def test_an_alarm_under_its_shelf_and_its_pairs_expiring_on_two_nodes_is_told_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Both shelves' until has passed; two nodes' timer passes end one each (a page each: the
    other's row is held, skipped). Each end saw the other shelf past its until and the
    suppressed notification still the newest, so each sent a return of its own (two event
    ids): every ungrouped receiver was told twice. Now once."""
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        pair = await _shelve_pair(db, "pump-21")
        alarm_id = await _raise(db, "pump-21")
        own = await _shelve_alarm(db, alarm_id)
        await _consume_together(nodes)
        await db.execute(
            "UPDATE alarm_shelf SET shelved_at = now() - interval '8 h',"
            " until = now() - CASE WHEN id = $1 THEN interval '1 ms' ELSE interval '0' END"
            " WHERE id = ANY($2::bigint[])",
            own,
            [own, pair],
        )

        async def expire(conn: asyncpg.Connection) -> None:
            now = await alarm_repo.db_now(conn)
            assert len(await expire_due(conn, now, node_id="n", limit=1)) == 1

        await _ends_at_once(db_dsn, db, expire, expire)
        ended = await db.fetchval(
            "SELECT count(*) FROM alarm_shelf WHERE id = ANY($1::bigint[])"
            " AND ended_at IS NOT NULL",
            [own, pair],
        )
        assert ended == 2
        returns = await _returns(db, alarm_id)
        assert sorted(d["receiver"] for d in returns) == ["each", "hook"]


async def test_an_alarm_escalated_under_its_pairs_shelf_after_its_own_expired_is_told_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The timers are late (every node down for a while): the alarm's own shelf passed its
    until, then the alarm escalated, suppressed by its pair's shelf, whose until then passed
    too. One timer pass ends both, the earlier until first: that end tells the escalation
    (the newest suppressed), but its return was dated at that shelf's until, older than the
    escalation, so the pair's end found the escalation still the newest and told it again:
    every ungrouped receiver twice, under two event ids. Now once."""
    routes = ROUTES.replace('["alarm.created"]', '["alarm.created", "alarm.escalated"]')
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), routes)) as nodes,
    ):
        pair = await _shelve_pair(db, "pump-22")
        alarm_id = await _raise(db, "pump-22", severity="MAJOR")
        own = await _shelve_alarm(db, alarm_id)
        await _past_its_until(db, own)
        async with db.transaction():
            await transition(db, alarm_id, Action.CONFIRM, actor="op", node_id="n0")
        async with db.transaction():
            await transition(
                db, alarm_id, Action.ESCALATE, actor="system:escalation", node_id="n0",
                event_type=EventType.ALARM_ESCALATED,
            )  # fmt: skip
        await _consume_together(nodes)
        escalated = {
            d["receiver"]: d
            for d in await _deliveries(db, alarm_id)
            if d["event"] == "alarm.escalated"
        }
        assert {d["suppressed"] for d in escalated.values()} == {f"shelved (shelf {pair})"}
        await _past_its_until(db, pair)
        report = await _timers(nodes[0], "n1").run_once()
        assert sorted(report.unshelved) == sorted([own, pair])
        returns = await _returns(db, alarm_id)
        assert sorted((d["receiver"], d["event"]) for d in returns) == [
            ("each", "alarm.escalated"),
            ("hook", "alarm.escalated"),
        ]


async def test_a_shelf_lifted_as_the_quiet_hours_wake_its_alarm_leaves_it_told(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """An alarm raised in quiet hours (DELAYED, its notifications held PENDING), then shelved;
    the operator lifts the shelf just as the quiet hours end and a node's timer wakes it. The
    lift, not yet committed, found nothing suppressed (the held notifications are pending);
    the wake, seeing the shelf still in force, suppressed the held notifications naming it.
    Then the lift commits: the alarm is unshelved and awake, and no receiver is ever told."""
    quiet = _quiet_now()
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        for node in nodes:
            node.consumer.quiet = quiet
        alarm_id = await _raise(db, "ward-20", severity="MAJOR")
        await _consume_together(nodes)
        assert await _status(db, alarm_id) == "DELAYED"
        shelf_id = await _shelve_alarm(db, alarm_id)

        async def lift_it(conn: asyncpg.Connection) -> None:
            await lift(conn, shelf_id, actor="op", node_id="n0", request_id=None)

        async def wake(conn: asyncpg.Connection) -> None:
            report = await _timers(nodes[1], "n2").run_once()  # the quiet hours are over
            assert report.woken == [alarm_id]

        await _ends_at_once(db_dsn, db, lift_it, wake)
        await wait_until(
            lambda: _got(server, "/hook", "/each"),
            message="each ungrouped receiver told of the alarm, awake and unshelved",
        )
