"""Grouped notifications and inhibition against a real PostgreSQL and a real webhook receiver,
with two nodes (each its own pool, consumer and delivery worker) on one database.

Group windows wait ``group_wait_s`` / ``group_interval_s``; rather than sleeping through
them, a test checks the due time the window was given and then moves that due time to now (as
the clock would), so what is asserted is the windowing, not a race with the clock."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
import pytest

from gateway.alarms.lifecycle import create_alarm, transition
from gateway.alarms.shelving import lift, shelve
from gateway.alarms.timers import AlarmTimers
from gateway.config import Config, parse_config
from gateway.domain.alarm import Action
from gateway.domain.quiet_hours import (
    QuietHours,
    QuietHoursConfig,
    QuietWindowConfig,
    compile_quiet_hours,
)
from gateway.notify.consumer import NotifyConsumer
from gateway.notify.groups import GroupWindows
from gateway.notify.metrics import NotifyMetrics
from gateway.notify.worker import DeliveryWorker
from gateway.support.metrics import Metrics
from protocol.events import EventType
from storage import alarms as alarm_repo
from storage import notify as notify_repo
from storage.desk import Scope
from storage.pool import create_pool
from tests.support.receivers import WebhookServer, webhook_server
from tests.support.waiting import wait_until

FAST = """
[notify]
max_attempts = 5
backoff_min_s = 0.01
backoff_max_s = 0.05
poll_s = 0.05
lease_s = 30
batch = 3

[[notify.sites]]
name = "north"
devices = ["gw-north", "north-*"]
"""


def _config(url: str, routes: str, inhibit: str = "") -> Config:
    return parse_config(
        FAST
        + f'[[notify.receivers]]\nname = "hook"\nkind = "webhook"\nurl = "{url}/hook"\n'
        + f'[[notify.receivers]]\nname = "each"\nkind = "webhook"\nurl = "{url}/each"\n'
        + routes
        + inhibit
    )


GROUPED = """
[[notify.routes]]
events = ["alarm.created"]
receivers = ["hook"]
group_by = ["rule"]
group_wait_s = 60
group_interval_s = 300
repeat_interval_s = 3600
continue = true

[[notify.routes]]
events = ["alarm.created"]
receivers = ["each"]
"""


class Node:
    def __init__(self, pool: asyncpg.Pool, dsn: str, config: Config, node_id: str) -> None:
        self.metrics = metrics = NotifyMetrics(Metrics().registry)
        rules = config.notify_rules()
        self.worker = DeliveryWorker(
            pool=pool, node_id=node_id, metrics=metrics, settings=config.notify, rules=rules
        )
        self.consumer = NotifyConsumer(
            pool=pool, dsn=dsn, metrics=metrics, rules=rules, batch=config.notify.batch
        )

    async def drain(self) -> None:
        while await self.consumer.run_once():
            pass


@contextlib.asynccontextmanager
async def _two_nodes(db_dsn: str, config: Config) -> AsyncIterator[tuple[Node, Node]]:
    one = await create_pool(db_dsn, min_size=1, max_size=3)
    two = await create_pool(db_dsn, min_size=1, max_size=3)
    nodes = (Node(one, db_dsn, config, "n1"), Node(two, db_dsn, config, "n2"))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(n.worker.run(stop)) for n in nodes]
    try:
        yield nodes
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await one.close()
        await two.close()


async def _consume_together(nodes: tuple[Node, Node]) -> None:
    """Both consumers at once, each passing until neither finds anything."""
    barrier = asyncio.Barrier(2)

    async def run(node: Node) -> None:
        await barrier.wait()
        await node.drain()

    await asyncio.gather(*(run(n) for n in nodes))
    await asyncio.gather(*(n.drain() for n in nodes))


async def _raise(db: asyncpg.Connection, device: str, rule: str, n: int) -> int:
    async with db.transaction():
        creation = await create_alarm(
            db, device_id=device, rule_key=rule, severity="MAJOR",
            telemetry_event_id=f"{n:064x}", reason="test", node_id="n0",
            now=await alarm_repo.db_now(db),
        )  # fmt: skip
    assert creation.alarm is not None
    return creation.alarm.id


async def _escalate(db: asyncpg.Connection, alarm_id: int) -> None:
    """The alarm confirmed, then escalated by the system (an ``alarm.escalated`` event)."""
    async with db.transaction():
        await transition(db, alarm_id, Action.CONFIRM, actor="op", node_id="n0")
        await transition(
            db, alarm_id, Action.ESCALATE, actor="system:escalation", node_id="n0",
            event_type=EventType.ALARM_ESCALATED,
        )  # fmt: skip


async def _one_repeat_of_two_nodes(
    nodes: tuple[Node, Node], db: asyncpg.Connection
) -> dict[str, Any]:
    """Node one's consumer makes the group's repeat and holds it uncommitted; node two's
    passes meanwhile: the group is taken, it makes none. Then both consume: one repeat."""
    one, two = nodes
    before = len(await _windows(db))
    async with one.worker.pool.acquire() as held, held.transaction():
        assert await GroupWindows(held).repeat() == 1
        await two.drain()
        assert len(await _windows(db)) == before
    await _consume_together(nodes)
    windows = await _windows(db)
    assert len(windows) == before + 1
    repeat = windows[-1]
    assert repeat["body"]["repeat"] is True
    return repeat


async def _windows(db: asyncpg.Connection) -> list[dict[str, Any]]:
    """The grouped deliveries, oldest first, their bodies decoded."""
    rows = await db.fetch("SELECT * FROM notify_delivery WHERE event = 'notify.group' ORDER BY id")
    return [{**dict(r.items()), "body": msgspec.json.decode(r["body"])} for r in rows]


async def _make_due(db: asyncpg.Connection, delivery_id: int) -> None:
    """The window's wait is over (as the clock would have it)."""
    await db.execute(
        "UPDATE notify_delivery SET next_attempt_at = now() WHERE id = $1", delivery_id
    )


async def _statuses(db: asyncpg.Connection, ids: list[int]) -> dict[int, str]:
    rows = await db.fetch("SELECT id, status FROM alarm WHERE id = ANY($1::bigint[])", ids)
    return {r["id"]: r["status"] for r in rows}


def _listed(server: WebhookServer, n: int) -> list[int]:
    return sorted(x["alarm_id"] for x in server.on("/hook")[n].json["notifications"])


async def test_n_alarms_in_a_window_make_one_delivery_with_two_nodes_and_push_only_once_received(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    n = 12
    # The receiver refuses the window's first attempt: nothing is pushed until it takes it.
    async with webhook_server(hook=lambda k, _r: 500 if k == 0 else 200) as server:
        config = _config(server.url(""), GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            hot = [await _raise(db, f"dev-{k}", "hot", k) for k in range(n)]
            cold = await _raise(db, "dev-x", "cold", 99)
            await _consume_together(nodes)
            consumed = [n.metrics.events_consumed._value.get() for n in nodes]
            assert sum(consumed) == n + 1
            [first, other] = await _windows(db)
            assert (first["status"], first["attempts"]) == ("PENDING", 0)
            assert first["rule_key"] == "hot"
            assert other["rule_key"] == "cold"
            wait = first["next_attempt_at"] - first["created_at"]
            assert timedelta(seconds=59) < wait <= timedelta(seconds=61), wait
            body = first["body"]
            assert body["count"] == n
            assert sorted(x["alarm_id"] for x in body["notifications"]) == hot
            # The ungrouped route: one delivery per alarm, as without grouping.
            await wait_until(lambda: _sent_each(server, n + 1), message="every ungrouped one")
            # Inside group_wait: nothing grouped sent, nothing pushed by it.
            assert server.on("/hook") == []
            # One window due at a time: with both due at once, the two nodes send them
            # concurrently and the refusal (the first request to arrive) could fall on either.
            await _make_due(db, first["id"])
            await wait_until(lambda: _sent_each_hook(server, 1), message="the refused attempt")
            await _make_due(db, other["id"])
            for window in (first, other):
                await wait_until(
                    lambda w=window: _window_status(db, w["id"], "SENT"), message="window sent"
                )
        assert len(server.on("/hook")) == 3  # the refused attempt, then the two windows
        got = {r.json["group"]["rule"]: r for r in server.on("/hook")[1:]}
        assert sorted(x["alarm_id"] for x in got["hot"].json["notifications"]) == hot
        assert [x["alarm_id"] for x in got["cold"].json["notifications"]] == [cold]
        assert got["hot"].json["kind"] == "group"
        assert got["hot"].json["window"] == 1
        assert got["hot"].event_id == server.on("/hook")[0].event_id  # same window, retried
    # The ungrouped route's webhook answered at once: the alarms were PUSHED by it already;
    # the window's own audit rows say who pushed what.
    rows = await db.fetch(
        "SELECT alarm_id, note FROM alarm_audit WHERE action = 'push' ORDER BY alarm_id"
    )
    assert {r["alarm_id"] for r in rows} == {*hot, cold}
    assert len(rows) == n + 1  # each alarm pushed exactly once


async def _sent_each(server: WebhookServer, n: int) -> bool:
    return len(server.on("/each")) >= n


async def _window_status(db: asyncpg.Connection, delivery_id: int, status: str) -> bool:
    value = await db.fetchval("SELECT status FROM notify_delivery WHERE id = $1", delivery_id)
    return bool(value == status)


ONLY_GROUPED = GROUPED.split("continue = true", maxsplit=1)[0]


async def test_pushed_follows_the_grouped_delivery_and_its_receivers_acceptance(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server(hook=lambda k, _r: 503 if k < 2 else 200) as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            ids = [await _raise(db, f"dev-{k}", "hot", k) for k in range(5)]
            await _consume_together(nodes)
            [window] = await _windows(db)
            assert set((await _statuses(db, ids)).values()) == {"NEW"}
            await _make_due(db, window["id"])
            await wait_until(lambda: len(server.on("/hook")) >= 1, message="first attempt")
            # Refused: still NEW.
            assert set((await _statuses(db, ids)).values()) == {"NEW"}
            await wait_until(
                lambda: _window_status(db, window["id"], "SENT"), message="accepted at last"
            )
        assert set((await _statuses(db, ids)).values()) == {"PUSHED"}
        notes = await db.fetch(
            "SELECT alarm_id, actor, note FROM alarm_audit WHERE action = 'push' ORDER BY alarm_id"
        )
        assert [r["alarm_id"] for r in notes] == ids
        assert {r["actor"] for r in notes} == {"system:notify"}
        assert all(f"grouped delivery {window['id']}" in r["note"] for r in notes)
        assert len(server.on("/hook")) == 3


async def test_group_interval_then_repeat_interval(db_dsn: str, db: asyncpg.Connection) -> None:
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            early = [await _raise(db, f"dev-{k}", "hot", k) for k in range(3)]
            await _consume_together(nodes)
            [first] = await _windows(db)
            await _make_due(db, first["id"])
            await wait_until(lambda: _window_status(db, first["id"], "SENT"), message="sent")
            due_1 = await db.fetchval(
                "SELECT window_due_at FROM notify_group WHERE window_delivery_id = $1",
                first["id"],
            )
            # New alarms of the same group after the first window went: a second window,
            # group_interval_s after the first was due, listing only them.
            late = [await _raise(db, f"dev-{k}", "hot", k) for k in range(3, 5)]
            await _consume_together(nodes)
            [_, second] = await _windows(db)
            assert second["next_attempt_at"] == due_1 + timedelta(seconds=300)
            assert second["body"]["window"] == 2
            await _make_due(db, second["id"])
            await wait_until(lambda: _window_status(db, second["id"], "SENT"), message="sent")
            assert _listed(server, 1) == late
            # Nothing new; repeat_interval_s after the second window went, every alarm of the
            # group still open is sent again, the first window's too (one of the second's
            # was dealt with meanwhile), oldest first, once for both nodes.
            async with db.transaction():
                await transition(db, late[0], Action.FALSE, actor="op", node_id="n0")
            await _consume_together(nodes)
            assert len(await _windows(db)) == 2  # not yet: repeat_interval_s has not passed
            await db.execute(
                "UPDATE notify_delivery SET finished_at = finished_at - interval '3601 s' "
                "WHERE id = $1",
                second["id"],
            )
            await _consume_together(nodes)
            [*_, third] = await _windows(db)
            assert third["body"]["repeat"] is True
            listed = [n["alarm_id"] for n in third["body"]["notifications"]]
            assert listed == [*early, late[1]]
            assert third["body"]["count"] == 4
            await wait_until(lambda: _window_status(db, third["id"], "SENT"), message="sent")
            assert _listed(server, 2) == sorted([*early, late[1]])
            assert len(await _windows(db)) == 3
        assert len(server.on("/hook")) == 3


async def test_a_repeat_lists_every_open_alarm_of_the_group_once_on_two_nodes(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Three windows, alarms dealt with in each: the repeat lists every alarm of the group
    still open, the oldest window's first, however many windows ago it was sent; two nodes'
    consumers make it once (one holds the group while the other passes, then the other passes
    again). The repeat forgets the alarms dealt with (an alarm never reopens), so the next one
    reads only those still open; it lists them again, and an alarm closed since is left out."""
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            windows: list[list[int]] = []
            for ks in (range(3), range(3, 5), range(5, 7)):
                windows.append([await _raise(db, f"dev-{k}", "hot", k) for k in ks])
                await _consume_together(nodes)
                [*_, window] = await _windows(db)
                await _make_due(db, window["id"])
                await wait_until(
                    lambda w=window["id"]: _window_status(db, w, "SENT"), message="sent"
                )
            (a, b, c), (d, e), (f, g) = windows
            async with db.transaction():
                await transition(db, b, Action.HANDLE, actor="op", node_id="n0")
                await transition(db, d, Action.FALSE, actor="op", node_id="n0")
                await transition(db, g, Action.CONFIRM, actor="op", node_id="n0")  # still open
            await _sent_long_ago(db, window["id"])
            repeat = await _one_repeat_of_two_nodes(nodes, db)
            assert [n["alarm_id"] for n in repeat["body"]["notifications"]] == [a, c, e, f, g]
            await wait_until(lambda: _window_status(db, repeat["id"], "SENT"), message="sent")
            assert _listed(server, 3) == [a, c, e, f, g]
            remembered = await db.fetch("SELECT alarm_id FROM notify_group_member ORDER BY seq")
            assert [r["alarm_id"] for r in remembered] == [a, c, e, f, g]
            # The next repeat, on either node: the same, less an alarm closed since.
            async with db.transaction():
                await transition(db, e, Action.HANDLE, actor="op", node_id="n0")
            await _sent_long_ago(db, repeat["id"])
            await _consume_together(nodes)
            [*_, again] = await _windows(db)
            assert len(await _windows(db)) == 5
            assert [n["alarm_id"] for n in again["body"]["notifications"]] == [a, c, f, g]
            await wait_until(lambda: _window_status(db, again["id"], "SENT"), message="sent")
        assert [len(r.json["notifications"]) for r in server.on("/hook")] == [3, 2, 2, 5, 4]


ESCALATING = """
[[notify.routes]]
events = ["alarm.created", "alarm.escalated"]
receivers = ["hook"]
group_by = ["rule"]
group_wait_s = 60
group_interval_s = 300
repeat_interval_s = 3600
"""


async def test_a_repeat_lists_an_alarm_created_then_escalated_once_on_two_nodes(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """A repeat is a reminder of alarms, not of events: an alarm whose creation and then two
    escalations the group carried (in two windows) is listed once, in the place of its first
    notification, with its newest one (the second escalation), and ``count`` counts alarms.
    An ordinary window lists each event it carries (both escalations: each is news). Two
    nodes' consumers make the repeat once; it forgets the alarm's notifications between its
    first and its newest, and the next repeat lists it once too."""
    async with webhook_server() as server:
        config = _config(server.url(""), ESCALATING)
        async with _two_nodes(db_dsn, config) as nodes:
            a, b = [await _raise(db, f"dev-{k}", "hot", k) for k in range(2)]
            await _consume_together(nodes)
            [first] = await _windows(db)
            await _make_due(db, first["id"])
            await wait_until(lambda: _window_status(db, first["id"], "SENT"), message="sent")
            for _ in range(2):
                await _escalate(db, a)
                await _consume_together(nodes)
            [_, second] = await _windows(db)
            carried = second["body"]["notifications"]
            assert [(n["alarm_id"], n["event"]) for n in carried] == [(a, "alarm.escalated")] * 2
            newest = carried[-1]["event_id"]
            await _make_due(db, second["id"])
            await wait_until(lambda: _window_status(db, second["id"], "SENT"), message="sent")
            await _sent_long_ago(db, second["id"])
            repeat = await _one_repeat_of_two_nodes(nodes, db)
            listed = [
                (n["alarm_id"], n["event"], n["status"]) for n in repeat["body"]["notifications"]
            ]
            assert listed == [(a, "alarm.escalated", "ESCALATED"), (b, "alarm.created", "NEW")]
            assert repeat["body"]["notifications"][0]["event_id"] == newest
            assert repeat["body"]["count"] == 2
            members = await db.fetch(
                "SELECT alarm_id FROM notify_delivery_member WHERE delivery_id = $1"
                " ORDER BY alarm_id",
                repeat["id"],
            )
            assert [r["alarm_id"] for r in members] == [a, b]
            kept = await db.fetch("SELECT alarm_id, body FROM notify_group_member ORDER BY seq")
            # a's first escalation is forgotten: neither its place nor its body.
            events = [(r["alarm_id"], msgspec.json.decode(r["body"])["event"]) for r in kept]
            assert events == [(a, "alarm.created"), (b, "alarm.created"), (a, "alarm.escalated")]
            await wait_until(lambda: _window_status(db, repeat["id"], "SENT"), message="sent")
            assert _listed(server, 2) == [a, b]
            await _sent_long_ago(db, repeat["id"])
            await _consume_together(nodes)
            [*_, again] = await _windows(db)
            assert len(await _windows(db)) == 4
            assert again["body"]["notifications"][0]["event_id"] == newest
            assert [n["alarm_id"] for n in again["body"]["notifications"]] == [a, b]
            assert again["body"]["count"] == 2
            await wait_until(lambda: _window_status(db, again["id"], "SENT"), message="sent")
        assert [r.json["count"] for r in server.on("/hook")] == [2, 2, 2, 2]


async def _shelve(db: asyncpg.Connection, scope: Scope, alarm_id: int) -> asyncpg.Record:
    """An operator shelves the alarm (scope "alarm") or its device's rule ("pair") for an
    hour."""
    return await shelve(
        db, scope=scope, alarm_id=alarm_id, device_id=None, rule_key=None,
        seconds=3600, reason="known leak", actor="op", node_id="n0", request_id=None,
    )  # fmt: skip


async def _sent_long_ago(db: asyncpg.Connection, delivery_id: int) -> None:
    """repeat_interval_s has passed since the window was sent (as the clock would have it)."""
    await db.execute(
        "UPDATE notify_delivery SET finished_at = finished_at - interval '3601 s' WHERE id = $1",
        delivery_id,
    )


async def test_a_groups_repeat_leaves_out_shelved_alarms_and_stops_when_every_one_is(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """A shelved alarm sends no notifications (behaviour §5): a repeat lists the window's
    open alarms but those under a shelf in force, their own or their pair's (a shelf lifted
    counts no more). With every open alarm shelved the group stops repeating, as when none is
    open. Pushing is the first window's, once per alarm."""
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            ids = [await _raise(db, f"dev-{k}", "hot", k) for k in range(4)]
            await _consume_together(nodes)
            [first] = await _windows(db)
            await _make_due(db, first["id"])
            await wait_until(lambda: _window_status(db, first["id"], "SENT"), message="sent")
            async with db.transaction():
                await _shelve(db, "alarm", ids[0])
                await _shelve(db, "pair", ids[1])
                lifted = await _shelve(db, "pair", ids[2])
                await lift(db, lifted["id"], actor="op", node_id="n0", request_id=None)
            await _sent_long_ago(db, first["id"])
            await _consume_together(nodes)
            [_, repeat] = await _windows(db)
            assert repeat["body"]["repeat"] is True
            assert sorted(n["alarm_id"] for n in repeat["body"]["notifications"]) == ids[2:]
            members = await db.fetch(
                "SELECT alarm_id FROM notify_delivery_member WHERE delivery_id = $1"
                " ORDER BY alarm_id",
                repeat["id"],
            )
            assert [r["alarm_id"] for r in members] == ids[2:]
            await wait_until(lambda: _window_status(db, repeat["id"], "SENT"), message="sent")
            assert _listed(server, 1) == ids[2:]
            # The last two shelved as well: no repeat, and the group stops repeating.
            async with db.transaction():
                for alarm_id in ids[2:]:
                    await _shelve(db, "alarm", alarm_id)
            await _sent_long_ago(db, repeat["id"])
            await _consume_together(nodes)
            assert len(await _windows(db)) == 2
            assert await db.fetchval("SELECT repeat_stopped FROM notify_group") is True
        assert len(server.on("/hook")) == 2
    pushes = await db.fetch(
        "SELECT alarm_id, note FROM alarm_audit WHERE action = 'push' ORDER BY alarm_id"
    )
    assert [r["alarm_id"] for r in pushes] == ids
    assert all(f"grouped delivery {first['id']}" in r["note"] for r in pushes)


SITE_OFFLINE = """
[[notify.inhibit]]
name = "site-offline"
equal = ["site"]
[notify.inhibit.source]
rules = ["gateway-silent"]
[notify.inhibit.target]
rules = ["device-silent"]
"""

ROUTE_ALL = '[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["each"]\n'


async def test_a_sites_gateway_offline_mutes_its_devices_silent_alarms_until_it_closes(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server() as server:
        config = _config(server.url(""), ROUTE_ALL, SITE_OFFLINE)
        async with _two_nodes(db_dsn, config) as nodes:
            gateway = await _raise(db, "gw-north", "gateway-silent", 1)
            muted = [await _raise(db, f"north-{k}", "device-silent", 10 + k) for k in range(3)]
            elsewhere = await _raise(db, "south-1", "device-silent", 20)
            await _consume_together(nodes)
            await wait_until(lambda: _sent_each(server, 2), message="the two not inhibited")
            rows = {
                r["alarm_id"]: r
                for r in await db.fetch("SELECT * FROM notify_delivery WHERE receiver = 'each'")
            }
            for alarm_id in muted:
                assert rows[alarm_id]["status"] == "INHIBITED"
                assert rows[alarm_id]["inhibited_by"] == gateway
                assert rows[alarm_id]["inhibit_rule"] == "site-offline"
            assert rows[gateway]["status"] in ("PENDING", "SENDING", "SENT")
            assert rows[elsewhere]["inhibited_by"] is None
            # Created and shown, not notified.
            assert set((await _statuses(db, muted)).values()) == {"NEW"}
            # The source is dealt with (once its own notification's push has committed: the
            # receiver answers before the worker records it): later targets are notified again.

            async def gateway_pushed() -> bool:
                return (await _statuses(db, [gateway]))[gateway] == "PUSHED"

            await wait_until(gateway_pushed, message="the gateway's alarm pushed")
            async with db.transaction():
                await transition(db, gateway, Action.FALSE, actor="op", node_id="n0")
            after = await _raise(db, "north-9", "device-silent", 30)
            await _consume_together(nodes)
            await wait_until(lambda: _sent_each(server, 3), message="notified again")
        sent = sorted(r.json["alarm_id"] for r in server.on("/each"))
        assert sent == sorted([gateway, elsewhere, after])


@pytest.mark.parametrize("grouped", [True, False])
async def test_an_inhibited_alarm_joins_no_window(
    db_dsn: str, db: asyncpg.Connection, grouped: bool
) -> None:
    routes = (
        ONLY_GROUPED.replace('group_by = ["rule"]', 'group_by = ["site"]')
        if grouped
        else (ROUTE_ALL.replace('"each"', '"hook"'))
    )
    async with webhook_server() as server:
        config = _config(server.url(""), routes, SITE_OFFLINE)
        async with _two_nodes(db_dsn, config) as nodes:
            gateway = await _raise(db, "gw-north", "gateway-silent", 1)
            muted = await _raise(db, "north-1", "device-silent", 2)
            await _consume_together(nodes)
            status = await db.fetchval(
                "SELECT status FROM notify_delivery WHERE alarm_id = $1", muted
            )
            assert status == "INHIBITED"
            members = await db.fetchval(
                "SELECT count(*) FROM notify_delivery_member WHERE alarm_id = $1", muted
            )
            assert members == 0
            if grouped:
                [window] = await _windows(db)
                assert [x["alarm_id"] for x in window["body"]["notifications"]] == [gateway]


def _quiet_now() -> QuietHours:
    """Quiet hours for the care-* devices from an hour ago to an hour from now."""
    now = datetime.now(UTC)
    return compile_quiet_hours(
        QuietHoursConfig(windows=[QuietWindowConfig(
            devices="care-*", start=(now - timedelta(hours=1)).strftime("%H:%M"),
            end=(now + timedelta(hours=1)).strftime("%H:%M"))])
    )  # fmt: skip


async def test_a_nights_held_alarms_of_a_group_go_out_as_one_window_at_their_wake(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Quiet hours hold two alarms of the group (the consumer decides: DELAYED): they gather
    in a window of their own, which no claim takes while they are DELAYED, even once due; an
    exempt CRITICAL goes in the group's ordinary window and out. The wake releases the held
    window: one request lists both, and pushes both."""
    quiet = _quiet_now()
    async with webhook_server() as server:
        config = _config(
            server.url(""), ONLY_GROUPED.replace("group_wait_s = 60", "group_wait_s = 0")
        )
        async with _two_nodes(db_dsn, config) as nodes:
            for node in nodes:
                node.consumer.quiet = quiet
            held = [await _raise(db, f"care-{k}", "hot", k) for k in range(2)]
            async with db.transaction():
                creation = await create_alarm(
                    db, device_id="care-9", rule_key="hot", severity="CRITICAL",
                    telemetry_event_id=f"{99:064x}", reason="test", node_id="n0",
                    now=await alarm_repo.db_now(db),
                )  # fmt: skip
            assert creation.alarm is not None
            critical = creation.alarm.id
            await _consume_together(nodes)
            statuses = await _statuses(db, [*held, critical])
            assert (statuses[held[0]], statuses[held[1]]) == ("DELAYED", "DELAYED")
            # Not held: NEW, or already PUSHED if a worker (running meanwhile) sent its window.
            assert statuses[critical] in ("NEW", "PUSHED"), statuses
            windows = {w["body"]["group_key"]: w for w in await _windows(db)}
            assert set(windows) == {"routes[0]{rule=hot}", "routes[0]{rule=hot}|held"}
            night = windows["routes[0]{rule=hot}|held"]
            assert sorted(x["alarm_id"] for x in night["body"]["notifications"]) == held
            await wait_until(lambda: _sent_each_hook(server, 1), message="the CRITICAL one")
            assert [x["alarm_id"] for x in server.on("/hook")[0].json["notifications"]] == [
                critical
            ]
            await wait_until(
                lambda: _status_is(db, critical, "PUSHED"), message="the CRITICAL one pushed"
            )
            # Due, yet held: no claim takes it while its alarms are DELAYED.
            await _make_due(db, night["id"])
            for node in nodes:
                assert await node.worker.run_once() == 0
            timers = AlarmTimers(pool=nodes[0].worker.pool, node_id="n1", quiet=None,
                                 escalate_after_s=0, repeat_interval_s=0)  # fmt: skip
            report = await timers.run_once()
            assert sorted(report.woken) == held
            await wait_until(lambda: _window_status(db, night["id"], "SENT"), message="sent")
        assert len(server.on("/hook")) == 2
        assert sorted(x["alarm_id"] for x in server.on("/hook")[1].json["notifications"]) == held
    assert set((await _statuses(db, held)).values()) == {"PUSHED"}


async def _status_is(db: asyncpg.Connection, alarm_id: int, status: str) -> bool:
    return (await _statuses(db, [alarm_id]))[alarm_id] == status


async def _sent_each_hook(server: WebhookServer, n: int) -> bool:
    return len(server.on("/hook")) >= n


def _timers(node: Node, node_id: str) -> AlarmTimers:
    """A node's alarm timers (no quiet hours of their own, no escalation, no reminders)."""
    return AlarmTimers(pool=node.worker.pool, node_id=node_id, quiet=None,
                       escalate_after_s=0, repeat_interval_s=0)  # fmt: skip


async def _interval_passed(db: asyncpg.Connection) -> None:
    """group_interval_s has passed since the group's latest window was due (as the clock
    would have it)."""
    await db.execute(
        "UPDATE notify_group SET window_due_at = least(window_due_at, now()) - interval '301 s'"
    )


async def _night_window_sent(
    db: asyncpg.Connection, nodes: tuple[Node, Node], quiet: QuietHours, device: str = "care-0"
) -> tuple[int, dict[str, Any]]:
    """Quiet hours on both nodes' consumers; an alarm of ``device`` raised: its creation goes
    in the group's held window, which its wake (node one's timers) sends. The alarm and the
    window."""
    for node in nodes:
        node.consumer.quiet = quiet
    alarm = await _raise(db, device, "hot", int(device.rsplit("-", 1)[1]))
    await _consume_together(nodes)
    [*_, night] = await _windows(db)
    assert night["body"]["group_key"] == "routes[0]{rule=hot}|held"
    await _make_due(db, night["id"])
    assert (await _timers(nodes[0], "n1").run_once()).woken == [alarm]
    await wait_until(lambda: _window_status(db, night["id"], "SENT"), message="sent")
    return alarm, night


async def _escalated_by_day(
    db: asyncpg.Connection, nodes: tuple[Node, Node], alarm_id: int
) -> dict[str, Any]:
    """Quiet hours over, the alarm escalated: its escalation goes in the group's ordinary
    window, made due; the window."""
    for node in nodes:
        node.consumer.quiet = None
    await _escalate(db, alarm_id)
    await _consume_together(nodes)
    [*_, day] = await _windows(db)
    assert day["body"]["group_key"] == "routes[0]{rule=hot}"
    await _make_due(db, day["id"])
    return day


async def test_a_shelf_ending_brings_a_stopped_group_back_once_on_two_nodes(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """ISA-18.2: an unshelved alarm returns to annunciation. A group stopped repeating because
    its open alarms were all shelved; one shelf expires (two nodes' timers race, one ends it):
    the group repeats again, once for both nodes' consumers, no sooner than group_interval_s
    after its latest window was due, listing that alarm. The other shelf is lifted later: the
    next repeat lists that alarm too, though the latest window (the repeat) did not carry it."""
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            a, b, c = [await _raise(db, f"dev-{k}", "hot", k) for k in range(3)]
            await _consume_together(nodes)
            [first] = await _windows(db)
            await _make_due(db, first["id"])
            await wait_until(lambda: _window_status(db, first["id"], "SENT"), message="sent")
            async with db.transaction():
                expiring = await _shelve(db, "alarm", a)
                lifted = await _shelve(db, "pair", b)
                await transition(db, c, Action.FALSE, actor="op", node_id="n0")
            await _sent_long_ago(db, first["id"])
            await _consume_together(nodes)
            assert len(await _windows(db)) == 1  # every open alarm shelved: it stopped
            # The first shelf's until passes (as the clock would have it); both nodes' timers
            # look at once, one ends it.
            await db.execute(
                "UPDATE alarm_shelf SET shelved_at = now() - interval '2 h',"
                " until = now() - interval '1 s' WHERE id = $1",
                expiring["id"],
            )
            reports = await asyncio.gather(*(_timers(n, f"n{k}").run_once()
                                             for k, n in enumerate(nodes, 1)))  # fmt: skip
            assert sorted(s for r in reports for s in r.unshelved) == [expiring["id"]]
            # Owed a repeat, but not within group_interval_s of the latest window's due time.
            await _consume_together(nodes)
            assert len(await _windows(db)) == 1
            await _interval_passed(db)
            await _consume_together(nodes)
            [_, resumed] = await _windows(db)
            assert resumed["body"]["repeat"] is True
            assert [n["alarm_id"] for n in resumed["body"]["notifications"]] == [a]
            await wait_until(lambda: _window_status(db, resumed["id"], "SENT"), message="sent")
            assert _listed(server, 1) == [a]
            # A person lifts the pair's shelf: the next repeat lists b as well, once.
            async with db.transaction():
                await lift(db, lifted["id"], actor="op", node_id="n0", request_id=None)
            await _consume_together(nodes)
            assert len(await _windows(db)) == 2
            await _interval_passed(db)
            await _consume_together(nodes)
            [*_, again] = await _windows(db)
            assert [n["alarm_id"] for n in again["body"]["notifications"]] == [a, b]
            await wait_until(lambda: _window_status(db, again["id"], "SENT"), message="sent")
            await _consume_together(nodes)
            assert len(await _windows(db)) == 3  # paid: nothing more until repeat_interval_s
            # From there on the group repeats as any: repeat_interval_s after the last send.
            await _sent_long_ago(db, again["id"])
            await _consume_together(nodes)
            [*_, reminder] = await _windows(db)
            assert [n["alarm_id"] for n in reminder["body"]["notifications"]] == [a, b]
            assert len(await _windows(db)) == 4
            await wait_until(lambda: _window_status(db, reminder["id"], "SENT"), message="sent")
        assert [len(r.json["notifications"]) for r in server.on("/hook")] == [3, 1, 2, 2]


@pytest.mark.parametrize("shelved", ["one", "all"])
async def test_a_held_window_judges_its_alarms_again_at_their_wake(
    db_dsn: str, db: asyncpg.Connection, shelved: str
) -> None:
    """Quiet hours hold three alarms of a group in its held window; one (or all) is shelved
    before the wake. The wake (both nodes' timers racing; each alarm woken once) judges them
    as the ungrouped path does: a shelved one leaves the window, recorded SUPPRESSED on its
    own (naming its shelf, visible in the deliveries' list), never sent, pushing nothing; the
    rest of the window goes as one request. A window left empty is not sent."""
    quiet = _quiet_now()
    async with webhook_server() as server:
        config = _config(
            server.url(""), ONLY_GROUPED.replace("group_wait_s = 60", "group_wait_s = 0")
        )
        async with _two_nodes(db_dsn, config) as nodes:
            for node in nodes:
                node.consumer.quiet = quiet
            held = [await _raise(db, f"care-{k}", "hot", k) for k in range(3)]
            await _consume_together(nodes)
            assert set((await _statuses(db, held)).values()) == {"DELAYED"}
            [night] = await _windows(db)
            assert sorted(x["alarm_id"] for x in night["body"]["notifications"]) == held
            gone = held[:1] if shelved == "one" else held
            shelves = {}
            async with db.transaction():
                for alarm_id in gone:
                    shelves[alarm_id] = (await _shelve(db, "alarm", alarm_id))["id"]
            await _make_due(db, night["id"])
            reports = await asyncio.gather(*(_timers(n, f"n{k}").run_once()
                                             for k, n in enumerate(nodes, 1)))  # fmt: skip
            assert sorted(w for r in reports for w in r.woken) == held
            assert sum(r.suppressed for r in reports) == len(gone)
            rows = await db.fetch(
                "SELECT * FROM notify_delivery WHERE status = 'SUPPRESSED' AND group_id IS NULL"
                " ORDER BY alarm_id"
            )
            assert [r["alarm_id"] for r in rows] == gone
            for row in rows:
                assert row["receiver"] == "hook"
                assert row["event"] == "alarm.created"
                assert row["suppressed"] == f"shelved (shelf {shelves[row['alarm_id']]})"
            listed = await notify_repo.list_deliveries(
                db, status="SUPPRESSED", receiver="hook", event=None, before=None, limit=10
            )
            assert {r["alarm_id"] for r in listed} >= set(gone)
            members = await db.fetch(
                "SELECT alarm_id FROM notify_delivery_member WHERE delivery_id = $1"
                " ORDER BY alarm_id",
                night["id"],
            )
            kept = [a for a in held if a not in gone]
            assert [r["alarm_id"] for r in members] == kept
            if kept:
                await wait_until(lambda: _window_status(db, night["id"], "SENT"), message="sent")
                [request] = server.on("/hook")
                assert sorted(x["alarm_id"] for x in request.json["notifications"]) == kept
                assert request.json["count"] == len(kept)
                # The alarm that left the window is in no group: its shelf lifted, the group's
                # repeat does not list it.
                async with db.transaction():
                    await lift(db, shelves[gone[0]], actor="op", node_id="n0", request_id=None)
                await _sent_long_ago(db, night["id"])
                await _consume_together(nodes)
                [_, repeat] = await _windows(db)
                assert sorted(x["alarm_id"] for x in repeat["body"]["notifications"]) == kept
                await wait_until(lambda: _window_status(db, repeat["id"], "SENT"), message="sent")
            else:
                window = await db.fetchrow(
                    "SELECT status, suppressed FROM notify_delivery WHERE id = $1", night["id"]
                )
                assert window["status"] == "SUPPRESSED"
                for node in nodes:
                    assert await node.worker.run_once() == 0
        assert len(server.on("/hook")) == (2 if kept else 0)
    statuses = await _statuses(db, held)
    assert [statuses[a] for a in gone] == ["NEW"] * len(gone)  # reached nobody
    assert [statuses[a] for a in kept] == ["PUSHED"] * len(kept)


async def test_a_shelf_ended_and_at_once_renewed_owes_no_repeat(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """An operator shelves an alarm again whose shelf is past its until (the new shelf ends
    the old one first, in its transaction): the alarm stays shelved, so the group, still
    repeating its other alarm, gets no extra repeat; its own repeat comes as ever."""
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            a, b = [await _raise(db, f"dev-{k}", "hot", k) for k in range(2)]
            await _consume_together(nodes)
            [first] = await _windows(db)
            await _make_due(db, first["id"])
            await wait_until(lambda: _window_status(db, first["id"], "SENT"), message="sent")
            old = await _shelve(db, "alarm", a)
            await db.execute(
                "UPDATE alarm_shelf SET shelved_at = now() - interval '2 h',"
                " until = now() - interval '1 s' WHERE id = $1",
                old["id"],
            )
            async with db.transaction():
                renewed = await _shelve(db, "alarm", a)
            assert renewed["id"] != old["id"]
            await _interval_passed(db)
            await _consume_together(nodes)
            assert len(await _windows(db)) == 1
            await _sent_long_ago(db, first["id"])
            await _consume_together(nodes)
            [_, repeat] = await _windows(db)
            assert [n["alarm_id"] for n in repeat["body"]["notifications"]] == [b]
            await wait_until(lambda: _window_status(db, repeat["id"], "SENT"), message="sent")
        assert [len(r.json["notifications"]) for r in server.on("/hook")] == [2, 1]


@pytest.mark.parametrize("then", ["repeat", "shelf_end"])
async def test_a_held_window_emptied_at_its_wake_leaves_the_groups_repeats_going(
    db_dsn: str, db: asyncpg.Connection, then: str
) -> None:
    """A night's held window (alarm a) went out; the next night holds alarm b in the group's
    next held window, and b is shelved before its wake: the wake empties that window
    (SUPPRESSED, never sent). a is still open: the group repeats it as ever, repeat_interval_s
    on ("repeat"), or, a shelved since and its shelf lifted, group_interval_s on
    ("shelf_end"). The emptied window is not a send the repeats wait for forever."""
    quiet = _quiet_now()
    async with webhook_server() as server:
        config = _config(
            server.url(""), ONLY_GROUPED.replace("group_wait_s = 60", "group_wait_s = 0")
        )
        async with _two_nodes(db_dsn, config) as nodes:
            a, first = await _night_window_sent(db, nodes, quiet)
            shelf = await _shelve(db, "alarm", a) if then == "shelf_end" else None
            b = await _raise(db, "care-1", "hot", 1)
            await _consume_together(nodes)
            [_, night] = await _windows(db)
            assert night["body"]["group_key"] == first["body"]["group_key"]
            assert [x["alarm_id"] for x in night["body"]["notifications"]] == [b]
            await _shelve(db, "alarm", b)
            await _make_due(db, night["id"])
            reports = await asyncio.gather(*(_timers(n, f"n{k}").run_once()
                                             for k, n in enumerate(nodes, 1)))  # fmt: skip
            assert sorted(w for r in reports for w in r.woken) == [b]
            assert await _window_status(db, night["id"], "SUPPRESSED")
            if shelf is None:
                await _sent_long_ago(db, first["id"])
                await _sent_long_ago(db, night["id"])
            else:
                async with db.transaction():
                    await lift(db, shelf["id"], actor="op", node_id="n0", request_id=None)
                await _interval_passed(db)
            await _consume_together(nodes)
            windows = await _windows(db)
            assert len(windows) == 3, "a, still open, is never repeated"
            repeat = windows[-1]
            assert repeat["body"]["repeat"] is True
            assert [x["alarm_id"] for x in repeat["body"]["notifications"]] == [a]
            await wait_until(lambda: _window_status(db, repeat["id"], "SENT"), message="sent")
        assert [_listed(server, k) for k in range(len(server.on("/hook")))] == [[a], [a]]


async def test_a_shelf_lifted_as_a_repeat_pass_begins_is_listed_by_that_repeat(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """A repeat pass has begun on node one (its transaction open) when a person lifts the
    shelf of alarm a and commits; the pass then finds the group due its repeat: the repeat
    lists a, unshelved when it reads, as well as b. (It judged a at the time its transaction
    began: still shelved, left out, and the repeat cleared what the lift owed the group, so a
    was not told until the next repeat_interval_s.)"""
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            a, b = [await _raise(db, f"dev-{k}", "hot", k) for k in range(2)]
            await _consume_together(nodes)
            [first] = await _windows(db)
            await _make_due(db, first["id"])
            await wait_until(lambda: _window_status(db, first["id"], "SENT"), message="sent")
            shelf = await _shelve(db, "alarm", a)
            await _sent_long_ago(db, first["id"])
            async with nodes[0].worker.pool.acquire() as held, held.transaction():
                await held.fetchval("SELECT now()")  # node one's repeat pass has begun
                async with db.transaction():
                    await lift(db, shelf["id"], actor="op", node_id="n0", request_id=None)
                assert await GroupWindows(held).repeat() == 1
                await nodes[1].drain()  # the group is node one's: node two makes none
            await _interval_passed(db)
            await _consume_together(nodes)
            repeats = [w for w in await _windows(db) if w["body"]["repeat"]]
            listed = [[n["alarm_id"] for n in w["body"]["notifications"]] for w in repeats]
            assert listed == [[a, b]]
            await wait_until(lambda: _window_status(db, repeats[0]["id"], "SENT"), message="sent")
        assert [_listed(server, k) for k in range(len(server.on("/hook")))] == [[a, b], [a, b]]


async def test_a_shelf_lifted_before_its_held_window_goes_owes_the_group_no_repeat(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Quiet hours hold alarm b in the group's held window; b is shelved, and the shelf
    lifted, before the wake (both nodes' timers race it): the window, sent at the wake, tells
    b, for the first time. The lift owes the group no repeat: one group_interval_s later b
    was told again."""
    quiet = _quiet_now()
    async with webhook_server() as server:
        config = _config(
            server.url(""), ONLY_GROUPED.replace("group_wait_s = 60", "group_wait_s = 0")
        )
        async with _two_nodes(db_dsn, config) as nodes:
            for node in nodes:
                node.consumer.quiet = quiet
            b = await _raise(db, "care-1", "hot", 1)
            await _consume_together(nodes)
            [night] = await _windows(db)
            shelf = await _shelve(db, "alarm", b)
            async with db.transaction():
                await lift(db, shelf["id"], actor="op", node_id="n0", request_id=None)
            await _make_due(db, night["id"])
            reports = await asyncio.gather(*(_timers(n, f"n{k}").run_once()
                                             for k, n in enumerate(nodes, 1)))  # fmt: skip
            assert sorted(w for r in reports for w in r.woken) == [b]
            await wait_until(lambda: _window_status(db, night["id"], "SENT"), message="sent")
            await _interval_passed(db)
            await _consume_together(nodes)
            listed = [
                [n["alarm_id"] for n in w["body"]["notifications"]] for w in await _windows(db)
            ]
            assert listed == [[b]]
        assert [_listed(server, k) for k in range(len(server.on("/hook")))] == [[b]]


def _reload(node: Node, config: Config) -> None:
    """What a reload does to a node's notifications (gateway.runtime.components)."""
    rules = config.notify_rules()
    node.consumer.rules = rules
    node.worker.rules = rules


async def _day_window_sent(
    db: asyncpg.Connection, nodes: tuple[Node, Node], device: str, rule: str, n: int
) -> tuple[int, dict[str, Any]]:
    """An alarm of ``device`` and ``rule`` raised (``n``: its telemetry's number), grouped by
    both nodes into a window, and the window sent. The alarm and the window."""
    alarm = await _raise(db, device, rule, n)
    await _consume_together(nodes)
    [*_, window] = await _windows(db)
    await _make_due(db, window["id"])
    await wait_until(lambda: _window_status(db, window["id"], "SENT"), message="sent")
    return alarm, window


def _reload_all(nodes: tuple[Node, Node], config: Config) -> None:
    for node in nodes:
        _reload(node, config)


async def _one_window_sent(db: asyncpg.Connection, nodes: tuple[Node, Node]) -> dict[str, Any]:
    """Two alarms raised, grouped into one window by both nodes, and the window sent."""
    for k in range(2):
        await _raise(db, f"dev-{k}", "hot", k)
    await _consume_together(nodes)
    [window] = await _windows(db)
    await _make_due(db, window["id"])
    await wait_until(lambda: _window_status(db, window["id"], "SENT"), message="sent")
    return window


# The grouping route to "hook" removed; another route groups (for another receiver).
ELSEWHERE = """
[[notify.routes]]
events = ["alarm.created"]
receivers = ["each"]
continue = true

[[notify.routes]]
events = ["alarm.created"]
receivers = ["each"]
group_by = ["device"]
repeat_interval_s = 3600
"""


@pytest.mark.parametrize(
    ("reloaded", "both"),
    [
        (ELSEWHERE, True),  # the grouping route removed
        (ONLY_GROUPED.replace("repeat_interval_s = 3600", "repeat_interval_s = 0"), True),
        (ONLY_GROUPED.replace('receivers = ["hook"]', 'receivers = ["each"]'), True),
        (ELSEWHERE, False),  # a rolling reload: one node has it, the other not yet
    ],
    ids=["removed", "repeats-off", "receiver-changed", "one-node-reloaded"],
)
async def test_a_reload_that_no_longer_groups_for_a_receiver_ends_its_groups_repeats(
    db_dsn: str, db: asyncpg.Connection, reloaded: str, both: bool
) -> None:
    """A group repeats while its alarms are open, with the intervals its route had when its
    latest window was made. A reload that removes the route (or turns its repeats off, or
    sends it to another receiver) must end those repeats: an operator who took a receiver off
    a route is not paged by it every repeat_interval_s until each alarm closes. The node
    still on the old configuration does not bring them back."""
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            window = await _one_window_sent(db, nodes)
            for node in nodes if both else nodes[1:]:
                _reload(node, _config(server.url(""), reloaded))
            await _sent_long_ago(db, window["id"])
            # The reloaded node passes first (its reload's first pass), then both do: the
            # node on the old configuration reads the group as the reload left it.
            await nodes[1].drain()
            await _consume_together(nodes)
            assert len(await _windows(db)) == 1, "repeated after the reload"
            assert await db.fetchval("SELECT repeat_interval_s FROM notify_group") == 0
            # A shelf's end over one of its alarms owes such a group nothing either.
            [alarm] = await db.fetch("SELECT id FROM alarm ORDER BY id LIMIT 1")
            async with db.transaction():
                shelf = await _shelve(db, "alarm", alarm["id"])
            async with db.transaction():
                await lift(db, shelf["id"], actor="op", node_id="n0", request_id=None)
            await _interval_passed(db)
            await _consume_together(nodes)
            assert len(await _windows(db)) == 1
        assert len(server.on("/hook")) == 1


async def test_a_reload_that_changes_the_repeat_interval_repeats_at_the_new_one(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The route's repeat_interval_s lowered from an hour to ten minutes: the group sent
    eleven minutes ago repeats at the next pass, not an hour after its send; and its next
    repeat is ten minutes after this one."""
    async with webhook_server() as server:
        config = _config(server.url(""), ONLY_GROUPED)
        async with _two_nodes(db_dsn, config) as nodes:
            window = await _one_window_sent(db, nodes)
            await db.execute(
                "UPDATE notify_delivery SET finished_at = finished_at - interval '660 s' "
                "WHERE id = $1",
                window["id"],
            )
            await _consume_together(nodes)
            assert len(await _windows(db)) == 1  # an hour has not passed
            shorter = ONLY_GROUPED.replace("repeat_interval_s = 3600", "repeat_interval_s = 600")
            for node in nodes:
                _reload(node, _config(server.url(""), shorter))
            await _consume_together(nodes)
            [_, repeat] = await _windows(db)
            assert repeat["body"]["repeat"] is True
            assert repeat["body"]["count"] == 2
            stored = "SELECT repeat_interval_s, group_interval_s FROM notify_group"
            group = await db.fetchrow(stored)
            assert tuple(group) == (600, 300)
            await wait_until(lambda: _window_status(db, repeat["id"], "SENT"), message="sent")
        assert len(server.on("/hook")) == 2


async def test_an_alarm_held_by_night_and_escalated_by_day_is_repeated_by_one_group(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Alarm a is raised in quiet hours: its creation goes in the group's held window, sent
    at the wake. By day it is escalated: the escalation goes in the group's ordinary window.
    Both groups carried it; the receiver is reminded of it once per interval, by the group
    that carried its newest notification (the escalation, as the alarm stands), not by both.
    The held group, left with nothing to repeat, stops. Two nodes' consumers."""
    quiet = _quiet_now()
    async with webhook_server() as server:
        config = _config(
            server.url(""), ESCALATING.replace("group_wait_s = 60", "group_wait_s = 0")
        )
        async with _two_nodes(db_dsn, config) as nodes:
            a, night = await _night_window_sent(db, nodes, quiet)
            day = await _escalated_by_day(db, nodes, a)
            await wait_until(lambda: _window_status(db, day["id"], "SENT"), message="sent")
            await _sent_long_ago(db, night["id"])
            await _sent_long_ago(db, day["id"])
            await _consume_together(nodes)
            windows = await _windows(db)
            assert len(windows) == 3, [w["body"]["group_key"] for w in windows[2:]]
            repeat = windows[-1]
            assert repeat["body"]["group_key"] == "routes[0]{rule=hot}"
            assert [(n["alarm_id"], n["event"]) for n in repeat["body"]["notifications"]] == [
                (a, "alarm.escalated")
            ]
            stopped = "SELECT repeat_stopped FROM notify_group WHERE group_key LIKE '%|held'"
            assert await db.fetchval(stopped) is True
            await wait_until(lambda: _window_status(db, repeat["id"], "SENT"), message="sent")
        assert [_listed(server, k) for k in range(len(server.on("/hook")))] == [[a], [a], [a]]
