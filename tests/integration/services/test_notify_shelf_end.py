"""A shelf's end tells the routes that do not group of the alarms it kept quiet (ISA-18.2: an
unshelved alarm returns to annunciation; docs/notifications.md, "A shelf's end tells its
alarms again"), against a real PostgreSQL, real webhook receivers and two nodes (each its own
pool, consumer, delivery worker and alarm timers) on one database.

An operator shelves a device's rule for the night; the device raises an alarm under it: its
notifications are recorded SUPPRESSED (naming the shelf) and sent to nobody. When the shelf
ends (its until passes and the nodes' timers race to end it, or a person lifts it through the
API) and the alarm still stands, each ungrouped route's receiver is sent its newest suppressed
notification once, marked as returned from the shelf. A grouped route is the group's business
(its repeats) and gets nothing of it."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import asyncpg
import msgspec
import pytest

from gateway.alarms.lifecycle import clear_alarm, create_alarm, transition
from gateway.alarms.shelving import lift, shelve
from gateway.alarms.timers import AlarmTimers
from gateway.config import Config, TokenConfig, parse_config
from gateway.domain.alarm import Action
from gateway.domain.quiet_hours import (
    QuietHours,
    QuietHoursConfig,
    QuietWindowConfig,
    compile_quiet_hours,
)
from protocol.events import EventType
from storage import alarms as alarm_repo
from tests.integration.services.test_notify_grouping import (
    FAST,
    Node,
    _consume_together,
    _two_nodes,
)
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.api_server import serve_api
from tests.support.receivers import WebhookServer, smtp_server, webhook_server
from tests.support.waiting import wait_until

# "grp" through a route that groups (and continues); "hook" and "each" through one that does
# not: a receiver gets the grouping of the first route that chose it.
ROUTES = """
[[notify.routes]]
events = ["alarm.created"]
receivers = ["grp"]
group_by = ["rule"]
group_wait_s = 0
group_interval_s = 300
repeat_interval_s = 3600
continue = true

[[notify.routes]]
events = ["alarm.created"]
receivers = ["hook", "each"]
"""


def _config(url: str, routes: str = ROUTES) -> Config:
    hooks = "".join(
        f'[[notify.receivers]]\nname = "{name}"\nkind = "webhook"\nurl = "{url}/{name}"\n'
        for name in ("hook", "each", "grp")
    )
    return parse_config(FAST + hooks + routes)


async def _raise(db: asyncpg.Connection, device: str, severity: str = "CRITICAL") -> int:
    async with db.transaction():
        creation = await create_alarm(
            db, device_id=device, rule_key="hot", severity=severity,
            telemetry_event_id=uuid.uuid4().hex, reason="test", node_id="n0",
            now=await alarm_repo.db_now(db),
        )  # fmt: skip
    assert creation.alarm is not None
    return creation.alarm.id


async def _shelve_pair(db: asyncpg.Connection, device: str) -> int:
    """The night shift shelves the device's rule (the (device, rule) pair) for eight hours."""
    async with db.transaction():
        shelf = await shelve(
            db, scope="pair", alarm_id=None, device_id=device, rule_key="hot",
            seconds=8 * 3600, reason="known leak", actor="op", node_id="n0", request_id=None,
        )  # fmt: skip
    return int(shelf["id"])


async def _shelve_alarm(db: asyncpg.Connection, alarm_id: int) -> int:
    async with db.transaction():
        shelf = await shelve(
            db, scope="alarm", alarm_id=alarm_id, device_id=None, rule_key=None,
            seconds=8 * 3600, reason="known leak", actor="op", node_id="n0", request_id=None,
        )  # fmt: skip
    return int(shelf["id"])


async def _past_its_until(db: asyncpg.Connection, shelf_id: int) -> None:
    """The shelf's eight hours are over now (as the clock would have it): what was written
    before this stays written under the shelf."""
    await db.execute(
        "UPDATE alarm_shelf SET shelved_at = now() - interval '8 h', until = now() WHERE id = $1",
        shelf_id,
    )


def _timers(node: Node, node_id: str, quiet: QuietHours | None = None) -> AlarmTimers:
    return AlarmTimers(pool=node.worker.pool, node_id=node_id, quiet=quiet,
                       escalate_after_s=0, repeat_interval_s=0)  # fmt: skip


async def _deliveries(db: asyncpg.Connection, alarm_id: int) -> list[dict[str, Any]]:
    rows = await db.fetch(
        "SELECT id, receiver, status, suppressed, event, body::text AS body"
        " FROM notify_delivery WHERE alarm_id = $1 ORDER BY id",
        alarm_id,
    )
    return [{**dict(r.items()), "body": msgspec.json.decode(r["body"])} for r in rows]


async def _returns(db: asyncpg.Connection, alarm_id: int) -> list[dict[str, Any]]:
    """The deliveries a shelf's end made for the alarm."""
    return [d for d in await _deliveries(db, alarm_id) if "returned_from_shelf" in d["body"]]


def _got(server: WebhookServer, *paths: str) -> bool:
    return all(server.on(path) for path in paths)


async def _status(db: asyncpg.Connection, alarm_id: int) -> str:
    return str(await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id))


async def _no_more_than_once_each(nodes: tuple[Node, Node], server: WebhookServer) -> None:
    """Both nodes consume and send what is left: each ungrouped receiver was told once, the
    grouped one never."""
    await _consume_together(nodes)
    for node in nodes:
        await node.worker.run_once()
    assert [len(server.on(p)) for p in ("/hook", "/each", "/grp")] == [1, 1, 0]


async def _pushed(db: asyncpg.Connection, alarm_id: int) -> bool:
    return await _status(db, alarm_id) == "PUSHED"


async def test_a_shelf_expiring_on_two_nodes_tells_each_ungrouped_route_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The fault: at 03:00 a CRITICAL alarm is raised under a shelf (SUPPRESSED on every
    route); at the shelf's until both nodes' timers race to end it. Each ungrouped receiver
    gets the alarm once, marked as returned from the shelf, which pushes it; the grouped
    receiver gets nothing (its group never carried the alarm)."""
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        shelf_id = await _shelve_pair(db, "pump-1")
        alarm_id = await _raise(db, "pump-1")
        await _consume_together(nodes)
        before = await _deliveries(db, alarm_id)
        assert {(d["receiver"], d["status"], d["suppressed"]) for d in before} == {
            (name, "SUPPRESSED", f"shelved (shelf {shelf_id})") for name in ("hook", "each", "grp")
        }
        await _past_its_until(db, shelf_id)
        reports = await asyncio.gather(
            *(_timers(node, f"n{k}").run_once() for k, node in enumerate(nodes, 1))
        )
        assert sorted(s for r in reports for s in r.unshelved) == [shelf_id]
        await wait_until(
            lambda: _got(server, "/hook", "/each"),
            message="each ungrouped receiver told of the alarm the shelf kept quiet",
        )
        await wait_until(lambda: _pushed(db, alarm_id), message="pushed")
        returns = await _returns(db, alarm_id)
        assert sorted(d["receiver"] for d in returns) == ["each", "hook"]
        await _no_more_than_once_each(nodes, server)
    [suppressed] = [d for d in before if d["receiver"] == "hook"]
    got = server.on("/hook")[0]
    body = got.json
    assert body["event"] == "alarm.created"
    assert body["alarm_id"] == alarm_id
    assert body["returned_from_shelf"]["shelf_id"] == shelf_id
    assert body["returned_from_shelf"]["end_reason"] == "expired"
    assert body["returned_from_shelf"]["ended_by"] == "system:shelving"
    assert body["returned_from_shelf"]["suppressed_event_id"] == suppressed["body"]["event_id"]
    # A notification of its own: a new event id, the same on both receivers, in the header too.
    assert body["event_id"] != suppressed["body"]["event_id"]
    assert got.event_id == body["event_id"] == server.on("/each")[0].json["event_id"]
    assert body["payload"] == suppressed["body"]["payload"]  # the event as it was written
    assert body["status"] == "NEW"  # the alarm as it stood when its shelf ended
    assert len(await _returns(db, alarm_id)) == 2


async def test_a_shelf_lifted_through_the_api_tells_the_ungrouped_routes(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """`POST /shelves` for the night, an alarm under it, `DELETE /shelves/{id}` in the
    morning: the ungrouped receivers are told once, the return says it was lifted, by whom."""
    tokens = [TokenConfig(token=OPERATOR, role="operator", name="console")]
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""))) as nodes,
        serve_api(db_dsn, tokens) as served,
        aiohttp.ClientSession() as http,
    ):
        api = ApiClient(base=served.base, http=http)
        made = await api.call(
            "POST", "/shelves", token=OPERATOR,
            json={"device_id": "pump-2", "rule_key": "hot", "duration_s": 8 * 3600,
                  "reason": "known leak"},
        )  # fmt: skip
        assert made.status == 201, made.body
        alarm_id = await _raise(db, "pump-2")
        await _consume_together(nodes)
        assert {d["status"] for d in await _deliveries(db, alarm_id)} == {"SUPPRESSED"}
        lifted = await api.call("DELETE", f"/shelves/{made.body['id']}", token=OPERATOR)
        assert lifted.status == 200, lifted.body
        await wait_until(lambda: _got(server, "/hook", "/each"), message="told at the lift")
        await wait_until(lambda: _pushed(db, alarm_id), message="pushed")
        await _no_more_than_once_each(nodes, server)
    shelf = server.on("/each")[0].json["returned_from_shelf"]
    assert (shelf["shelf_id"], shelf["end_reason"], shelf["ended_by"]) == (
        made.body["id"],
        "lifted",
        "console",
    )


async def test_an_alarm_cleared_under_the_shelf_or_told_before_it_gets_nothing_at_its_end(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """An alarm raised under the shelf and cleared before its end: nothing at the end (it no
    longer stands). An alarm the routes told before it was shelved (nothing suppressed):
    nothing at the end either, the shelf's end is not a reminder."""
    async with webhook_server() as server:
        async with _two_nodes(db_dsn, _config(server.url(""))) as nodes:
            told = await _raise(db, "pump-3")
            await _consume_together(nodes)
            await wait_until(lambda: _got(server, "/hook", "/each"), message="told at once")
            told_shelf = await _shelve_alarm(db, told)
            cleared_shelf = await _shelve_pair(db, "pump-4")
            cleared = await _raise(db, "pump-4")
            await _consume_together(nodes)
            assert {d["status"] for d in await _deliveries(db, cleared)} == {"SUPPRESSED"}
            async with db.transaction():
                await clear_alarm(
                    db, device_id="pump-4", rule_key="hot", clear_event_id=uuid.uuid4().hex,
                    reason="normal", now=await alarm_repo.db_now(db),
                )  # fmt: skip
            await _past_its_until(db, told_shelf)
            async with db.transaction():
                await lift(db, cleared_shelf, actor="op", node_id="n0", request_id=None)
            report = await _timers(nodes[1], "n2").run_once()
            assert report.unshelved == [told_shelf]
            # Made in the transactions that ended the shelves, or never.
            assert await _returns(db, told) == []
            assert await _returns(db, cleared) == []
            await _consume_together(nodes)
            for node in nodes:
                await node.worker.run_once()
        assert [len(server.on(p)) for p in ("/hook", "/each")] == [1, 1]


def _quiet_now() -> QuietHours:
    """Quiet hours for the ward-* devices, every severity, from an hour ago to an hour on."""
    now = datetime.now(UTC)
    return compile_quiet_hours(
        QuietHoursConfig(exempt_severities=[], windows=[QuietWindowConfig(
            devices="ward-*", start=(now - timedelta(hours=1)).strftime("%H:%M"),
            end=(now + timedelta(hours=1)).strftime("%H:%M"))])
    )  # fmt: skip


async def test_a_shelf_ending_in_quiet_hours_is_held_until_the_wake_then_told(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The alarm raised under the shelf inside quiet hours is held (DELAYED) as well as
    suppressed. The shelf is lifted while the quiet hours last: its return is made, and held
    with its alarm (no claim takes it); at the wake it goes, once per ungrouped receiver."""
    quiet = _quiet_now()
    async with webhook_server() as server:
        async with _two_nodes(db_dsn, _config(server.url(""))) as nodes:
            for node in nodes:
                node.consumer.quiet = quiet
            shelf_id = await _shelve_pair(db, "ward-1")
            alarm_id = await _raise(db, "ward-1", severity="MAJOR")
            await _consume_together(nodes)
            assert await _status(db, alarm_id) == "DELAYED"
            async with db.transaction():
                await lift(db, shelf_id, actor="op", node_id="n0", request_id=None)
            returns = await _returns(db, alarm_id)
            assert sorted((d["receiver"], d["status"]) for d in returns) == [
                ("each", "PENDING"),
                ("hook", "PENDING"),
            ]
            for node in nodes:  # held: no claim takes a delivery of a DELAYED alarm
                assert await node.worker.run_once() == 0
            assert await _timers(nodes[0], "n1", quiet).run_once() is not None
            assert await _status(db, alarm_id) == "DELAYED"  # still quiet on this node
            report = await _timers(nodes[1], "n2").run_once()  # the quiet hours are over
            assert report.woken == [alarm_id]
            await wait_until(lambda: _got(server, "/hook", "/each"), message="told at the wake")
            await wait_until(lambda: _pushed(db, alarm_id), message="pushed")
            for node in nodes:
                await node.worker.run_once()
        assert [len(server.on(p)) for p in ("/hook", "/each", "/grp")] == [1, 1, 0]
    assert server.on("/hook")[0].json["returned_from_shelf"]["shelf_id"] == shelf_id


async def test_a_shelf_ending_in_quiet_hours_and_shelved_again_by_the_wake_tells_nobody(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The wake judges the held return again, as any held notification: the alarm shelved
    again by then (its own shelf now), the return is recorded SUPPRESSED, naming that shelf,
    and never sent."""
    quiet = _quiet_now()
    async with webhook_server() as server:
        async with _two_nodes(db_dsn, _config(server.url(""))) as nodes:
            for node in nodes:
                node.consumer.quiet = quiet
            shelf_id = await _shelve_pair(db, "ward-2")
            alarm_id = await _raise(db, "ward-2", severity="MAJOR")
            await _consume_together(nodes)
            async with db.transaction():
                await lift(db, shelf_id, actor="op", node_id="n0", request_id=None)
            again = await _shelve_alarm(db, alarm_id)
            report = await _timers(nodes[1], "n2").run_once()
            assert report.woken == [alarm_id]
            returns = await _returns(db, alarm_id)
            assert sorted((d["receiver"], d["status"], d["suppressed"]) for d in returns) == [
                ("each", "SUPPRESSED", f"shelved (shelf {again})"),
                ("hook", "SUPPRESSED", f"shelved (shelf {again})"),
            ]
            for node in nodes:
                assert await node.worker.run_once() == 0
        assert [len(server.on(p)) for p in ("/hook", "/each", "/grp")] == [0, 0, 0]


async def test_a_consumer_behind_the_shelfs_end_settles_what_the_end_owes_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The consumer is behind (down, or held back by a long transaction): the alarm raised
    under the shelf is read only after the shelf expired. Its notifications are recorded
    SUPPRESSED (written under the shelf), and the end, which could not see them, is settled
    by the consumer that made them: each ungrouped receiver told once, both nodes reading."""
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        shelf_id = await _shelve_pair(db, "pump-5")
        alarm_id = await _raise(db, "pump-5")
        await _past_its_until(db, shelf_id)
        report = await _timers(nodes[0], "n1").run_once()
        assert report.unshelved == [shelf_id]
        assert await _deliveries(db, alarm_id) == []  # nothing read yet
        await _consume_together(nodes)
        returns = await _returns(db, alarm_id)
        assert sorted(d["receiver"] for d in returns) == ["each", "hook"]
        await wait_until(lambda: _got(server, "/hook", "/each"), message="told")
        await _no_more_than_once_each(nodes, server)
    assert server.on("/hook")[0].json["returned_from_shelf"]["end_reason"] == "expired"


async def _waiting_on_a_lock(db: asyncpg.Connection) -> bool:
    return bool(
        await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    )


async def test_a_shelf_ending_while_the_consumer_reads_its_alarm_is_settled_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The interleaving forced: a person's lift is written (the shelf ended, what it owes
    read: nothing suppressed yet) but not committed while a consumer reads the alarm's event,
    written under the shelf. The consumer waits for the lift on the shelf's row, then finds
    it ended and settles what the end owes: each ungrouped receiver told once."""
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        shelf_id = await _shelve_pair(db, "pump-6")
        alarm_id = await _raise(db, "pump-6")
        ender = await asyncpg.connect(db_dsn)
        try:
            lifting = ender.transaction()
            await lifting.start()
            await lift(ender, shelf_id, actor="op", node_id="n0", request_id=None)
            reading = asyncio.create_task(nodes[0].drain())
            await wait_until(
                lambda: reading.done() or _waiting_on_a_lock(db),
                message="the consumer waits for the lift, or is done",
            )
            await lifting.commit()
            await reading
        finally:
            await ender.close()
        assert {d["status"] for d in await _deliveries(db, alarm_id)} >= {"SUPPRESSED"}
        returns = await _returns(db, alarm_id)
        assert sorted(d["receiver"] for d in returns) == ["each", "hook"]
        await wait_until(lambda: _got(server, "/hook", "/each"), message="told")
        await _no_more_than_once_each(nodes, server)


async def test_an_email_receiver_is_told_at_the_shelfs_end_with_the_subject_saying_so(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """A real SMTP server behind an ungrouped route: the mail sent at the shelf's lift has the
    event's own subject with "(shelf ended)" and a line naming the shelf."""
    with smtp_server() as smtp:
        config = parse_config(
            FAST + f'[[notify.receivers]]\nname = "mail"\nkind = "email"\nhost = "127.0.0.1"\n'
            f'port = {smtp.port}\nfrom = "gateway@example.com"\nto = ["ops@example.com"]\n'
            '[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["mail"]\n'
        )
        async with _two_nodes(db_dsn, config) as nodes:
            shelf_id = await _shelve_pair(db, "pump-7")
            alarm_id = await _raise(db, "pump-7")
            await _consume_together(nodes)
            async with db.transaction():
                await lift(db, shelf_id, actor="op", node_id="n0", request_id=None)
            await wait_until(lambda: _pushed(db, alarm_id), message="mailed, pushed")
        [mail] = smtp.handler.mails
    assert mail.message["Subject"] == "[CRITICAL] hot on pump-7: alarm.created (shelf ended)"
    plain = mail.message.get_body(("plain",))
    assert plain is not None
    assert f'"shelf_id":{shelf_id}' in plain.get_content()


async def test_the_newest_notification_the_shelf_kept_quiet_returns_once_per_alarm(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Raised, confirmed and escalated under the shelf (both events SUPPRESSED on a route of
    both): at the shelf's end the alarm returns once per receiver, as its escalation, with its
    status and times as they are then."""
    async with webhook_server() as server:
        routes = ROUTES.replace('["alarm.created"]', '["alarm.created", "alarm.escalated"]')
        async with _two_nodes(db_dsn, _config(server.url(""), routes)) as nodes:
            shelf_id = await _shelve_pair(db, "pump-8")
            alarm_id = await _raise(db, "pump-8", severity="MAJOR")
            async with db.transaction():
                await transition(db, alarm_id, Action.CONFIRM, actor="op", node_id="n0")
            async with db.transaction():
                await transition(
                    db, alarm_id, Action.ESCALATE, actor="system:escalation", node_id="n0",
                    event_type=EventType.ALARM_ESCALATED,
                )  # fmt: skip
            await _consume_together(nodes)
            suppressed = await _deliveries(db, alarm_id)
            assert sorted((d["event"], d["receiver"]) for d in suppressed) == sorted(
                (event, receiver)
                for event in ("alarm.created", "alarm.escalated")
                for receiver in ("each", "grp", "hook")
            )
            async with db.transaction():
                await lift(db, shelf_id, actor="op", node_id="n0", request_id=None)
            await wait_until(lambda: _got(server, "/hook", "/each"), message="told")
            await _no_more_than_once_each(nodes, server)
    body = server.on("/hook")[0].json
    assert (body["event"], body["status"]) == ("alarm.escalated", "ESCALATED")
    assert {"triggered_at", "confirmed_at", "escalated_at"} <= set(body["times"])
    [escalation] = [
        d for d in suppressed if d["receiver"] == "hook" and d["event"] == "alarm.escalated"
    ]
    assert body["returned_from_shelf"]["suppressed_event_id"] == escalation["body"]["event_id"]


async def test_a_shelf_renewed_past_its_until_tells_nobody_until_the_renewal_ends_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The night shift's shelf is past its until when the day shift shelves the pair again
    (the new shelf ends the old one in its transaction): the alarm stays shelved, so nothing
    is sent then. When the renewal is lifted the alarm the first shelf kept quiet is told,
    once per receiver. Shelved and lifted once more with nothing new: nothing more (the
    return was its newest notification)."""
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        night = await _shelve_pair(db, "pump-9")
        alarm_id = await _raise(db, "pump-9")
        await _consume_together(nodes)
        await _past_its_until(db, night)
        day = await _shelve_pair(db, "pump-9")
        assert day != night
        assert await _returns(db, alarm_id) == []
        async with db.transaction():
            await lift(db, day, actor="op", node_id="n0", request_id=None)
        returns = await _returns(db, alarm_id)
        assert sorted(d["receiver"] for d in returns) == ["each", "hook"]
        assert {d["body"]["returned_from_shelf"]["shelf_id"] for d in returns} == {day}
        await wait_until(lambda: _got(server, "/hook", "/each"), message="told")
        again = await _shelve_pair(db, "pump-9")
        async with db.transaction():
            await lift(db, again, actor="op", node_id="n0", request_id=None)
        assert len(await _returns(db, alarm_id)) == 2
        await _no_more_than_once_each(nodes, server)


async def test_a_silence_in_force_at_the_shelfs_end_silences_the_return(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """A silence stops people being notified: one over the device in force when the shelf is
    lifted makes the return SILENCED (visible, never sent), as any notification."""
    async with webhook_server() as server:
        async with _two_nodes(db_dsn, _config(server.url(""))) as nodes:
            shelf_id = await _shelve_pair(db, "pump-10")
            alarm_id = await _raise(db, "pump-10")
            await _consume_together(nodes)
            silence = await db.fetchval(
                "INSERT INTO notify_silence (matchers, ends_at, comment, created_by)"
                """ VALUES ('{"devices": "pump-10"}', now() + interval '1 h', 'x', 'op')"""
                " RETURNING id"
            )
            async with db.transaction():
                await lift(db, shelf_id, actor="op", node_id="n0", request_id=None)
            returns = await _returns(db, alarm_id)
            assert sorted((d["receiver"], d["status"]) for d in returns) == [
                ("each", "SILENCED"),
                ("hook", "SILENCED"),
            ]
            assert {
                r["silence_id"]
                for r in await db.fetch(
                    "SELECT silence_id FROM notify_delivery WHERE id = ANY($1::bigint[])",
                    [d["id"] for d in returns],
                )
            } == {silence}
            for node in nodes:
                assert await node.worker.run_once() == 0
        assert [len(server.on(p)) for p in ("/hook", "/each", "/grp")] == [0, 0, 0]


ONLY_EACH = '\n[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["each"]\n'


@pytest.mark.xfail(
    strict=True,
    reason="a limit (notifications.md, 'The routes as they were'): the end tells the receivers "
    "the routes chose when the notification was suppressed; the timers and the API that end "
    "shelves do not hold the routes",
)
async def test_a_route_removed_by_a_reload_under_the_shelf_is_not_told_at_its_end(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Under the shelf an operator reloads the routes: "hook" is routed no longer (its
    receiver still configured). At the shelf's end the routes then in force would decide."""
    async with webhook_server() as server, _two_nodes(db_dsn, _config(server.url(""))) as nodes:
        shelf_id = await _shelve_pair(db, "pump-30")
        alarm_id = await _raise(db, "pump-30")
        await _consume_together(nodes)
        assert {d["status"] for d in await _deliveries(db, alarm_id)} == {"SUPPRESSED"}
        reloaded = _config(server.url(""), ONLY_EACH)
        for node in nodes:  # SIGHUP
            node.consumer.rules = reloaded.notify_rules()
            node.worker.replace(reloaded.notify, reloaded.notify_rules())
        async with db.transaction():
            await lift(db, shelf_id, actor="op", node_id="n0", request_id=None)
        returns = await _returns(db, alarm_id)
        assert sorted(d["receiver"] for d in returns) == ["each"]


@pytest.mark.xfail(
    strict=True,
    reason="a limit (notifications.md, 'A consumer far behind at the end'): each (shelf, "
    "alarm) returns once per receiver, as the newest notification read by the end",
)
async def test_an_escalation_read_after_the_lift_returns_as_the_escalation(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Raised under the shelf (read: SUPPRESSED), then escalated under it; the consumer is
    behind the escalation when the shelf is lifted. The alarm would return as its
    escalation, the newest notification the shelf suppressed."""
    async with webhook_server() as server:
        routes = ROUTES.replace('["alarm.created"]', '["alarm.created", "alarm.escalated"]')
        async with _two_nodes(db_dsn, _config(server.url(""), routes)) as nodes:
            shelf_id = await _shelve_pair(db, "pump-31")
            alarm_id = await _raise(db, "pump-31", severity="MAJOR")
            await _consume_together(nodes)
            async with db.transaction():
                await transition(db, alarm_id, Action.CONFIRM, actor="op", node_id="n0")
            async with db.transaction():
                await transition(
                    db, alarm_id, Action.ESCALATE, actor="system:escalation", node_id="n0",
                    event_type=EventType.ALARM_ESCALATED,
                )  # fmt: skip
            async with db.transaction():
                await lift(db, shelf_id, actor="op", node_id="n0", request_id=None)
            await _consume_together(nodes)  # behind: reads the escalation only now
            returns = await _returns(db, alarm_id)
            assert sorted((d["receiver"], d["event"]) for d in returns) == [
                ("each", "alarm.escalated"),
                ("hook", "alarm.escalated"),
            ]
