"""Command reaping, on every node: lapsed claims back to PENDING (a new generation), receipts
that never came to TIMEOUT or FAILED, expired commands to EXPIRED — each a conditional write,
so whichever node passes first does it once.

A receipt that never came is judged only by a node that could have heard it: one whose broker
session, and its own passes against the database, have been up for the whole ack window. While
the broker (or the database) was away, a device's receipt waits at the broker, or in the
ingest queue, and comes once they are back; judged before, the command a device carried out
was failed or sent again, and its receipt refused as closed (docs/commands.md, Reaper).
What the node received and has not stored yet (its ingest writer's lag: PostgreSQL slow to take
telemetry, a lock, a backlog after an outage) is not heard yet either: the window stops at the
oldest such message's receipt, as the inactivity monitor's hearing does. Nor is what another
node of the `$share` group holds unstored (its database away for a moment, its writer
lagging): each pass writes up to when its node has stored what it received
(``command_hearing``), and a node judges only commands sent an ack window before that of
every other node that passed within ``COMMAND_HEARING_LIVE_S``. Nor, last, what waits at
the broker in a node's persistent session while that session is down (mosquitto routes a
`$share` group's messages to a disconnected member's session too): the mark does not pass the
last pass at which the node's session had been up for an ack window, until the session has
been up that long again, or has been down longer than ``[mqtt] session_expiry_s`` (the broker
dropped what it kept) or ``BROKER_AWAY_HELD_S`` (taken for gone, as a stopped node).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import asyncpg
import structlog

from gateway.alarms.lifecycle import create_alarm
from gateway.commands.lifecycle import record_change
from gateway.commands.metrics import CommandMetrics
from gateway.commands.receipts import AppliedReceipt, apply_receipt, count_receipts
from gateway.config import CommandsConfig
from gateway.domain.command import ReceiptOutcome, needs_people
from gateway.domain.errors import ConcurrentWriteError
from gateway.domain.mappings import Mappings
from gateway.support.broker_link import BrokerLink
from gateway.support.loops import every
from gateway.support.metrics import Metrics
from gateway.support.node import Node
from protocol import CommandReceipt, ReceiptResult
from storage import alarms as alarm_repo
from storage import commands as repo
from storage.commands import CommandRow

log = structlog.get_logger(__name__)

REAPER_ACTOR = "system:reaper"
# The alarm raised for people when a command keeps losing its node (docs/behaviour.md §7).
RECLAIM_RULE_KEY = "command-reclaims"
RECLAIM_SEVERITY = "MAJOR"

# How recently another node's reaper must have passed for what it holds unstored to be waited
# for: one cut from the database longer than this (or stopped) is taken for gone.
COMMAND_HEARING_LIVE_S = 60.0
# How long, at most, a node whose broker session is down (its database fine) holds the other
# nodes' ack-window timeouts back for what the broker may keep for it (below): past this it is
# taken for gone, as a stopped node is, and the others judge again (a receipt that waited for it
# is then kept as `duplicated` when it comes). Up to the session's expiry, a node cut from the
# broker by a partition held every realtime command's TIMEOUT in the group back for a day.
BROKER_AWAY_HELD_S = 300.0

Transition = tuple[str, str]  # (from status, to status): one audited status change


@dataclass(slots=True)
class ReapReport:
    reclaimed: list[int]
    timed_out_receipts: list[int]
    failed: list[int]
    expired: list[tuple[int, str]]  # (id, the status it left)
    alarms: list[int]
    # Every status change the pass audited, whichever step made it (metrics count these).
    transitions: list[Transition] = field(default_factory=list)
    # The node's own TIMEOUT receipts (each kept as a receipt row), counted as receipts are.
    receipts: list[AppliedReceipt] = field(default_factory=list)


async def reap(
    conn: asyncpg.Connection,
    *,
    node_id: str,
    ack_window_s: float,
    sent_timeout_s: float,
    heard_for_s: float = math.inf,
    unstored_s: float = 0.0,
    unheard_s: float = 0.0,
    mappings: Sequence[str] = (),
    hearing_live_s: float = COMMAND_HEARING_LIVE_S,
) -> ReapReport:
    """One pass of the reaper in the caller's transaction; every write is conditional.
    ``heard_for_s``: how long the node has been able to hear receipts (its broker session and
    the database up, up to the oldest message it holds unstored); a missing receipt is judged
    only once that covers the ack window. ``unstored_s``: how long ago that oldest unstored
    message was received (0: none): a receipt received since may wait in the ingest queue, so
    only commands sent that much longer than the ack window ago are judged.
    ``mappings``: the names of the [[ingest.mappings]] configured, whose devices answer no
    receipt (their commands go out on vendor topics). The pass records up to when this node has
    stored what it received (``unstored_s`` ago), for the other nodes' passes; it judges only
    commands sent an ack window before that of every other node that passed within
    ``hearing_live_s``: a receipt one of them holds unstored is not missing. ``unheard_s``:
    how long ago the node's broker session last heard everything (0: it does now): what the
    broker holds for the session since then is not stored either, so the mark stays there."""
    report = ReapReport([], [], [], [], [])
    await repo.record_hearing(conn, node_id, max(unstored_s, unheard_s))
    for row in await repo.reclaim_expired(conn):
        report.reclaimed.append(row.id)
        report.transitions.append(("CLAIMED", row.status))
        note = f"lease expired (node {row.claimed_node_id})"
        await record_change(
            conn,
            row,
            from_status="CLAIMED",
            actor=REAPER_ACTOR,
            action="reclaim",
            node_id=node_id,
            note=note,
        )
        if needs_people(row.reclaim_count):
            alarm_id = await _reclaim_alarm(conn, row, node_id)
            if alarm_id is not None:
                report.alarms.append(alarm_id)
    if 0 < ack_window_s <= heard_for_s:
        passed = await repo.ack_window_passed(
            conn,
            ack_window_s + unstored_s,
            mappings,
            node_id=node_id,
            ack_window_s=ack_window_s,
            live_s=hearing_live_s,
        )
        for row in passed:
            # The node reports TIMEOUT itself: the same effect as a device's TIMEOUT receipt.
            own = CommandReceipt(
                command_id=row.id,
                claim_generation=row.claim_generation,
                node_id=row.claimed_node_id,
                result=ReceiptResult.TIMEOUT,
                raw_ack=f"no receipt within {ack_window_s:g}s (reported by {node_id})",
            )
            applied = await apply_receipt(
                conn,
                device_id=row.device_id,
                receipt=own,
                node_id=node_id,
                sent_timeout_s=sent_timeout_s,
            )
            report.receipts.append(applied)
            if applied.outcome is ReceiptOutcome.ACCEPTED:
                report.timed_out_receipts.append(row.id)
            moved = applied.command
            if moved is not None and applied.previous_status not in (None, moved.status):
                report.transitions.append((str(applied.previous_status), moved.status))
    for row in await repo.fail_sent_timeout(conn):
        report.failed.append(row.id)
        report.transitions.append(("SENT", row.status))
        await record_change(
            conn, row, from_status="SENT", actor=REAPER_ACTOR, action="timeout", node_id=node_id
        )
    for row in await repo.expire(conn):
        report.expired.append((row.id, row.previous_status))
        report.transitions.append((row.previous_status, row.status))
        await record_change(
            conn,
            row,
            from_status=row.previous_status,
            actor=REAPER_ACTOR,
            action="expire",
            node_id=node_id,
        )
    return report


async def _reclaim_alarm(conn: asyncpg.Connection, row: CommandRow, node_id: str) -> int | None:
    # One alarm per command that crossed the limit: the dedup key is derived from the command.
    stand_in = hashlib.sha256(f"command-reclaims\n{row.id}".encode()).hexdigest()
    try:
        async with conn.transaction():  # a savepoint: losing the race must not abort the pass
            creation = await create_alarm(
                conn,
                device_id=row.device_id,
                rule_key=RECLAIM_RULE_KEY,
                severity=RECLAIM_SEVERITY,
                telemetry_event_id=stand_in,
                reason=(
                    f"command {row.id} ({row.name}) was reclaimed "
                    f"{row.reclaim_count} times: its node keeps losing contact"
                ),
                node_id=node_id,
                now=await alarm_repo.db_now(conn),
            )
    except ConcurrentWriteError:
        return None
    return None if creation.alarm is None else creation.alarm.id


class Reaper:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        node_id: str,
        ack_window_s: float,
        sent_timeout_s: float,
        interval_s: float,
        metrics: Metrics,
        broker: BrokerLink | None = None,
        clock: Callable[[], float] = time.monotonic,
        mappings: Mappings | None = None,
        unstored_since: Callable[[], float | None] | None = None,
        session_expiry_s: float = math.inf,
        away_held_s: float = BROKER_AWAY_HELD_S,
    ) -> None:
        self.metrics = metrics
        self.command_metrics = CommandMetrics.of(metrics.registry)
        self.pool = pool
        self.node_id = node_id
        self.ack_window_s = ack_window_s
        self.sent_timeout_s = sent_timeout_s
        self.interval_s = interval_s
        self.broker = broker or BrokerLink()
        self.clock = clock
        # [[ingest.mappings]] (swapped whole on reload, as the dispatcher's): a device read
        # through one of these gets vendor commands and answers no receipt.
        self.mappings = mappings or Mappings()
        # Since when this node has been able to hear receipts (None: it cannot now): from its
        # start, and again from each reconnect of its broker session (the wakeup) and from the
        # first pass after one that could not reach the database.
        self._reconnected = self.broker.wakeup()
        self._hearing_since: float | None = clock()
        # When the oldest message this node holds unstored was received (``clock``'s time;
        # None: none held): its ingest writer's lag. A receipt waiting there is not heard yet.
        self._unstored_since = unstored_since or (lambda: None)
        # The broker session alone (the database aside): since when it has been up (None: it
        # is down), and the last pass at which it had been up for an ack window, so that what
        # the broker queued for it while it was down (a `$share` group's receipts included)
        # has come. From the node's start: what its session kept from before is unknown.
        self._session_since: float | None = None
        self._session_heard_at = clock()
        # The first pass that found the session down, of the outage now (None: it is up).
        self._session_down_since: float | None = None
        # After this long down the broker has dropped the session and what it kept for it.
        self.session_expiry_s = session_expiry_s
        # After this long down the node is taken for gone all the same (BROKER_AWAY_HELD_S).
        self.away_held_s = away_held_s

    @classmethod
    def from_config(
        cls,
        node: Node,
        commands: CommandsConfig,
        *,
        mappings: Mappings | None = None,
        unstored_since: Callable[[], float | None] | None = None,
        session_expiry_s: float = math.inf,
    ) -> Reaper:
        return cls(
            pool=node.pool,
            node_id=node.node_id,
            ack_window_s=commands.ack_window_s,
            sent_timeout_s=commands.sent_timeout_s,
            interval_s=commands.reaper_interval_s,
            metrics=node.metrics,
            broker=node.broker,
            mappings=mappings,
            unstored_since=unstored_since,
            session_expiry_s=session_expiry_s,
        )

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.interval_s, stop, self.run_once, name="command-reaper")

    def heard_for_s(self) -> float:
        """How long this node has been able to hear receipts, up to now (0: it cannot)."""
        now = self.clock()
        if self._reconnected.is_set():
            self._reconnected.clear()
            self._hearing_since = now
            self._session_since = now
        if not self.broker.up():
            self._hearing_since = None
            self._session_since = None
            if self._session_down_since is None:
                self._session_down_since = now
        else:
            self._session_down_since = None
            if self._hearing_since is None:
                self._hearing_since = now
            if self._session_since is None:
                self._session_since = now
            if now - self._session_since >= self.ack_window_s:
                self._session_heard_at = now
        return 0.0 if self._hearing_since is None else now - self._hearing_since

    def unheard_s(self) -> float:
        """How long ago the broker session last heard everything the broker held for it (0:
        it does now, or has been down so long that the broker dropped the session, or that the
        node is taken for gone: ``away_held_s``); asked right after :meth:`heard_for_s`."""
        now = self.clock()
        if self._session_since is not None and self._session_heard_at >= self._session_since:
            return 0.0
        down = self._session_down_since
        if down is not None and now - down > min(self.session_expiry_s, self.away_held_s):
            return 0.0
        return max(now - self._session_heard_at, 0.0)

    def unstored_s(self) -> float:
        """How long ago the oldest message this node holds unstored was received (0: none)."""
        since = self._unstored_since()
        return 0.0 if since is None else max(self.clock() - since, 0.0)

    async def run_once(self) -> None:
        try:
            async with self.pool.acquire() as conn:
                # The pass judges the ack windows that ended by its transaction's start (the
                # statements' now()): how long the node has heard is asked after that start,
                # once the connection is had, and what passed since ``began`` (before it) is
                # not counted. Asked before the wait for a connection (a busy pool), a session
                # lost during it was not seen: a window that ended while the node heard
                # nothing was judged, and a command whose receipt waited at the broker for the
                # node's session was timed out.
                began = self.clock()
                async with conn.transaction():
                    # The lag first: a message stored between the two reads is then only
                    # counted late.
                    unstored_s = self.unstored_s()
                    heard_for_s = max(self.heard_for_s() - unstored_s - (self.clock() - began), 0.0)
                    # What the broker holds for the session while it is down (or has just
                    # come back) is not stored either: the node's mark, for the other nodes'
                    # passes, stays where the session last heard everything. It used to be
                    # now (its database fine): another node timed out a command whose
                    # receipt waited at the broker for this node's session, and the receipt
                    # was kept as `duplicated` at the reconnect.
                    unheard_s = self.unheard_s()
                    report = await reap(
                        conn,
                        node_id=self.node_id,
                        ack_window_s=self.ack_window_s,
                        sent_timeout_s=self.sent_timeout_s,
                        heard_for_s=heard_for_s,
                        unstored_s=unstored_s,
                        unheard_s=unheard_s,
                        mappings=list(self.mappings.by_name),
                    )
        except Exception:
            # The database out of reach (or the pass failed): receipts may be waiting in the
            # ingest queue for it. The window starts again from the next pass that gets through.
            self._hearing_since = None
            raise
        # After the commit: a pass that rolled back changed nothing.
        for (from_status, to_status), n in Counter(report.transitions).items():
            self.metrics.count_command(from_status, to_status, n)
        count_receipts(self.command_metrics, report.receipts)
        if any((report.reclaimed, report.timed_out_receipts, report.failed, report.expired)):
            log.info(
                "commands_reaped",
                reclaimed=report.reclaimed,
                timed_out=report.timed_out_receipts,
                failed=report.failed,
                expired=report.expired,
                alarms=report.alarms,
            )
