"""Group windows (docs/notifications.md, "Grouping"): a grouped route's notifications for one
receiver gathered into one delivery per window, exactly once across nodes.

In the consumer's transaction, for each notification: the group's row is locked (made if
new), then its latest window's delivery, if nobody has claimed it yet (``open_window``, locked
too: a claim skips it until this transaction ends). An open window gets the notification
appended to its body; otherwise a new window is made, due when the route's grouping says
(``Grouping.window_due``), with an event id derived from the group and the window number: a
second node making the same window would find that id taken. Two consumers on two nodes adding to
one group queue on the group's row; a window, once claimed, takes nothing more.

The notifications of alarms that quiet hours hold (DELAYED) gather in a window of their own
(the group's key with ``|held``), due when the quiet hours are expected to end: no claim takes
a window while one of its alarms is DELAYED, and the wake of an alarm makes its window due.
So a night's held alarms of one group go out together when the night ends, not one by one.

The repeat pass (each consumer pass, any node, ``SKIP LOCKED``): a group whose latest window
was SENT at least ``repeat_interval_s`` ago gets a new window (more than the route's
``group_max_notifications`` alarms: consecutive windows, parts of one repeat), due now,
listing every alarm its windows carried that is still open and not shelved now, once, with
the newest of its notifications the group carried, in the order the alarms were first
carried, however many windows ago (``repeat: true``; ``count`` counts alarms); when none is
left the group stops repeating. What a repeating group carried is kept apart from the window bodies
(``notify_group_member``, one row per notification with an alarm, written with the window's
member row when the route repeats: a route that never repeats keeps nothing); the pass
deletes the rows of alarms it finds dealt with, and those of an open alarm between its first
and its newest, so each repeat reads the group's alarms open at the one before (two rows at
most each) and those carried since, not its whole history. A shelf's end over open
alarms of a repeating group (gateway.alarms.shelving, decided once, recorded on the group in
the same transaction) owes the group a repeat, whether it had stopped or not: made at that
end, but no sooner than ``group_interval_s`` after the latest window was due (and once that
window is sent), it lists the group's open alarms as any repeat (those freed among them), and
the group repeats again from there. If by then none of the freed ones is open and unshelved,
nothing is owed.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

import asyncpg
import msgspec

from gateway.domain.notify import Route, reminding_route, route_of_group
from gateway.domain.notify_match import Facts
from gateway.domain.notify_policy import GROUP_MAX_NOTIFICATIONS, Sites
from protocol.notifications import GroupedNotification
from storage import notify as repo
from storage.notify import NewWindow, OutboxRow

# Window event ids: uuid5 of "<group id>\n<receiver>\n<group key>\n<window>" in this namespace
# (the group's id too: a group made again after its row was deleted never reuses an id).
_WINDOWS: Final = uuid.UUID("0b7f6c1e-6a53-4f0e-9b1c-2d1f3c5e7a90")
REPEAT_BATCH: Final = 50
# The group key of a group's notifications whose alarms quiet hours hold (DELAYED).
HELD_SUFFIX: Final = "|held"


def window_event_id(group_id: int, receiver: str, group_key: str, window: int) -> uuid.UUID:
    return uuid.uuid5(_WINDOWS, f"{group_id}\n{receiver}\n{group_key}\n{window}")


@dataclass(frozen=True, slots=True)
class Pending:
    """A notification for a grouped route's receiver, not yet in a window."""

    row: OutboxRow
    fact: Facts
    body: dict[str, Any]
    receiver: str
    route: Route
    # Seconds its alarm is expected to stay DELAYED (quiet hours); None: not held.
    held_for_s: float | None = None


class GroupWindows:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def add(self, pending: Sequence[Pending], sites: Sites, now: datetime) -> int:
        """Put each notification in its group's window (in the caller's transaction); the
        number of windows opened."""
        opened = 0
        # One lock order for every node: two transactions adding to the same groups cannot
        # wait on each other in a circle.
        keyed = []
        for item in pending:
            assert item.route.grouping is not None
            key, labels = item.route.grouping.group(item.route.index, item.fact, sites)
            if item.held_for_s is not None:
                # Held ones gather apart: their window waits for the wake, the group's other
                # one does not.
                key += HELD_SUFFIX
            keyed.append((item.receiver, key, labels, item))
        keyed.sort(key=lambda k: (k[0], k[1]))
        for receiver, key, labels, item in keyed:
            if await self._add_one(receiver, key, labels, item, now):
                opened += 1
        return opened

    async def _add_one(
        self, receiver: str, key: str, labels: dict[str, str], item: Pending, now: datetime
    ) -> bool:
        conn = self.conn
        grouping = item.route.grouping
        assert grouping is not None
        group = await repo.lock_group(conn, receiver, key, labels)
        listed = await repo.open_window(conn, group.window_delivery_id)
        if listed is not None and listed < grouping.max_notifications:
            assert group.window_delivery_id is not None
            await repo.append_to_window(conn, group.window_delivery_id, item.body)
            await repo.add_member(
                conn, group.window_delivery_id, item.row.event_id, item.fact.alarm_id,
                group_id=group.id, body=item.body if grouping.repeat_s else None,
            )  # fmt: skip
            return False
        if listed is not None and group.window_due_at is not None:
            # The latest window is full and not sent yet: the next one goes with it (a storm
            # is sent as several windows at once, not one per group_interval_s).
            due = group.window_due_at
        elif item.held_for_s is None:
            due = grouping.window_due(now, group.window_due_at)
        else:
            due = now + timedelta(seconds=item.held_for_s)
        await self._open(
            group_id=group.id,
            window=group.windows + 1,
            receiver=receiver,
            key=key,
            labels=labels,
            items=[(item.row.event_id, item.fact.alarm_id, item.body)],
            outbox_id=item.row.id,
            event_created_at=item.row.created_at,
            due=due,
            repeat_s=grouping.repeat_s,
            interval_s=grouping.interval_s,
            repeat=False,
            route_identity=item.route.identity,
        )
        return True

    async def _open(
        self,
        *,
        group_id: int,
        window: int,
        receiver: str,
        key: str,
        labels: dict[str, str],
        items: list[tuple[uuid.UUID, int | None, Any]],
        outbox_id: int,
        event_created_at: datetime,
        due: datetime,
        repeat_s: float,
        interval_s: float,
        repeat: bool,
        route_identity: str | None = None,
    ) -> None:
        event_id = window_event_id(group_id, receiver, key, window)
        body = GroupedNotification(
            event_id=str(event_id),
            receiver=receiver,
            group_key=key,
            group=labels,
            window=window,
            repeat=repeat,
            count=len(items),
            notifications=[body for _, _, body in items],
        )
        delivery_id = await repo.insert_window(
            self.conn,
            NewWindow(
                event_id=event_id,
                outbox_id=outbox_id,
                receiver=receiver,
                body=body,
                due_at=due,
                event_created_at=event_created_at,
                group_id=group_id,
                device_id=labels.get("device") or None,
                rule_key=labels.get("rule") or None,
                severity=labels.get("severity") or None,
            ),
        )
        # Under the group's lock the window number is new: taken only if a pruned row left
        # its id behind, and then the delivery exists already.
        assert delivery_id is not None, f"window {window} of {key} exists already"
        for member_event, alarm_id, item_body in items:
            await repo.add_member(
                self.conn, delivery_id, member_event, alarm_id,
                group_id=group_id, body=None if repeat or not repeat_s else item_body,
            )  # fmt: skip
        await repo.set_window(
            self.conn,
            group_id,
            windows=window,
            delivery_id=delivery_id,
            due_at=due,
            repeat_interval_s=repeat_s,
            group_interval_s=interval_s,
            repeat=repeat,
            route_identity=route_identity,
        )

    async def retime(self, routes: Sequence[Route]) -> int:
        """The stored groups' intervals made those of ``routes`` (this node's configuration,
        after its start or a reload): a group's repeats follow the route it repeats for now
        (``route_of_group``: by its identity wherever it stands, else in its place if it
        accepts the group's labels), and stop where no grouping route makes it any more for
        its receiver (removed, its repeats turned off, or the receiver taken off it).
        Without this a group kept the intervals stored with its latest window, and a reload
        that removed its route went on repeating its open alarms to the receiver. The number
        of groups changed."""
        times = []
        for group in await repo.groups_to_retime(self.conn):
            route = route_of_group(
                routes,
                receiver=group["receiver"],
                group_key=group["group_key"],
                labels=msgspec.json.decode(group["labels"]),
                identity=group["route_identity"],
            )
            grouping = None if route is None else route.grouping
            repeat_s = 0.0 if grouping is None else grouping.repeat_s
            interval_s = group["group_interval_s"] if grouping is None else grouping.interval_s
            if (repeat_s, interval_s) != (group["repeat_interval_s"], group["group_interval_s"]):
                times.append(repo.GroupTimes(group["id"], repeat_s, interval_s))
        changed = await repo.retime_groups(self.conn, times) if times else 0
        # What a repeat lists depends on the routes too (a route edited to no longer accept
        # a group's alarms leaves them out, and the group stops): the groups stopped with
        # an alarm still open are judged again under these routes at their next repeat.
        await repo.wake_stopped_groups(self.conn)
        return changed

    async def _kept(
        self,
        group: asyncpg.Record,
        route: Route,
        routes: Sequence[Route],
        alarm_id: int | None,
        notification: dict[str, Any],
    ) -> bool:
        """Whether a group's repeat lists this open alarm (its newest notification the group
        carried): if the route the group repeats for is the one that sends its receiver that
        notification now (``reminding_route``: the route's events and matchers, and its
        place, since a route ahead of it that matches without ``continue`` takes the
        notification); or if another grouping route that repeats sends it now (a route that
        moved off the group's place, whose group row the route moved in took over), as long
        as no group of that route for the receiver carries the alarm (one reminder per alarm
        and route). Else nobody would send the receiver this alarm now: it is not reminded
        of it."""
        reminder = reminding_route(routes, group["receiver"], notification)
        if reminder is None:
            return False
        if reminder.identity == route.identity:
            return True
        if alarm_id is None:
            return False
        return not await repo.route_carries_alarm(
            self.conn, group["id"], group["receiver"], reminder.identity, alarm_id
        )

    async def repeat(self, routes: Sequence[Route] | None = None) -> int:
        """Repeat the groups due for it (see the module); the number of windows made. The
        intervals are the ones stored with the group's latest window. With ``routes`` (this
        node's configuration) a repeat lists only the alarms the route it repeats for now
        (``route_of_group``) still sends its receiver (``_kept``): a group whose key a route
        moved into its place took over lists no alarm of the route removed from there, nor
        one a route put ahead of it takes, nor one whose event the route no longer sends."""
        made = 0
        async with self.conn.transaction():
            now = await repo.db_now(self.conn)
            for group in await repo.repeat_due(self.conn, REPEAT_BATCH):
                items = [
                    (r["event_id"], r["alarm_id"], msgspec.json.decode(r["body"]))
                    for r in await repo.group_open_members(self.conn, group["id"])
                ]
                labels = msgspec.json.decode(group["labels"])
                route = (
                    None
                    if routes is None
                    else route_of_group(
                        routes,
                        receiver=group["receiver"],
                        group_key=group["group_key"],
                        labels=labels,
                        identity=group["route_identity"],
                    )
                )
                if route is not None and routes is not None:
                    items = [
                        item
                        for item in items
                        if await self._kept(group, route, routes, item[1], item[2])
                    ]
                if group["resuming"] and not group["interval_due"]:
                    freed = set(group["resume_alarm_ids"])
                    if not any(alarm_id in freed for _, alarm_id, _ in items):
                        # What the shelf's end freed is closed, or shelved again, by now: no
                        # repeat is owed, and the group's own repeats go on as they were.
                        await repo.drop_resume(self.conn, group["id"])
                        continue
                if not items:
                    await repo.stop_repeating(self.conn, group["id"])
                    continue
                # More open alarms than a window may list: the repeat is sent in parts, each a
                # window of its own (its own number and event id), made together here.
                grouping = None if route is None else route.grouping
                size = GROUP_MAX_NOTIFICATIONS if grouping is None else grouping.max_notifications
                for part, start in enumerate(range(0, len(items), size)):
                    await self._open(
                        group_id=group["id"],
                        window=group["windows"] + 1 + part,
                        receiver=group["receiver"],
                        key=group["group_key"],
                        labels=labels,
                        items=items[start : start + size],
                        outbox_id=group["outbox_id"],
                        event_created_at=group["event_created_at"],
                        due=now,
                        repeat_s=group["repeat_interval_s"],
                        interval_s=group["group_interval_s"],
                        repeat=True,
                    )
                    made += 1
        return made
