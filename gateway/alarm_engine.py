"""Rules applied to freshly stored telemetry, inside the ingest transaction.

The firing state is a cache of the database (active, uncleared alarms), loaded at start.
Each batch evaluates against a staged overlay of it; the overlay is committed into the cache
only after the database commit, so a rolled-back batch leaves the cache as the database is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg
import structlog

from gateway.alarms import (
    EVENT_CLEARED,
    AlarmRequest,
    SummarySpec,
    clear_alarm,
    create_alarms,
)
from gateway.domain.alarm import active_key
from gateway.metrics import Metrics
from gateway.rules import (
    IDLE,
    Clearing,
    Firing,
    FiringState,
    InactivityRule,
    RuleSet,
    StagedState,
    StateChange,
    evaluate,
)
from protocol import Telemetry
from storage import alarms as repo
from storage import outbox

log = structlog.get_logger("gateway.alarms")


@dataclass(slots=True)
class BatchAlarms:
    """What one batch did to alarms, applied to the cache and metrics after the commit."""

    staged: StagedState
    created: list[tuple[str, int]] = field(default_factory=list)
    superseded: int = 0
    deduplicated: int = 0
    cleared: int = 0


class AlarmEngine:
    def __init__(self, *, rules: RuleSet, node_id: str, metrics: Metrics) -> None:
        self.rules = rules
        self.node_id = node_id
        self.metrics = metrics
        self.state = FiringState()
        self.summary: SummarySpec | None = None  # set when AI summaries are enabled

    async def load(self, conn: asyncpg.Connection) -> None:
        """Derive the firing state from the database (a restarted node decides the same)."""
        self.state.load(await repo.firing(conn))

    async def on_stored(
        self, conn: asyncpg.Connection, messages: Sequence[tuple[str, str, Telemetry]]
    ) -> BatchAlarms:
        """Evaluate (device id, event id, message) in order; write alarms on ``conn``."""
        rules = self.rules  # one rule set per batch, even if a reload swaps it meanwhile
        batch = BatchAlarms(staged=self.state.stage())
        if not messages or not len(rules):
            return batch
        now = await repo.db_now(conn)
        await self._clear_inactivity(conn, rules, messages, now, batch)
        # Firings are written in runs, one statement per step for the whole run (an alarm
        # storm is one run). A run ends before a clearing and before a second firing of the
        # same (device, rule): outcomes still take effect in message order, so one message
        # may raise an alarm and clear it again (OPEN then CLOSE).
        run: list[Firing] = []
        in_run: set[tuple[str, str]] = set()
        for device_id, event_id, message in messages:
            evaluation = evaluate(rules, batch.staged, device_id, event_id, message)
            for outcome in evaluation.outcomes:
                if isinstance(outcome, Firing):
                    if (outcome.device_id, outcome.rule_key) in in_run:
                        await self._fire(conn, run, now, batch)
                        in_run.clear()
                    run.append(outcome)
                    in_run.add((outcome.device_id, outcome.rule_key))
                else:
                    await self._fire(conn, run, now, batch)
                    in_run.clear()
                    await self._clear(conn, outcome, now, batch)
        await self._fire(conn, run, now, batch)
        return batch

    def committed(self, batch: BatchAlarms) -> None:
        self.state.commit(batch.staged)
        m = self.metrics
        for rule_key, alarm_id in batch.created:
            m.alarms_created.labels(rule_key).inc()
            log.info("alarm_created", alarm_id=alarm_id, rule_key=rule_key)
        m.alarms_superseded.inc(batch.superseded)
        m.alarms_deduplicated.inc(batch.deduplicated)
        m.alarms_cleared.inc(batch.cleared)

    async def _fire(
        self, conn: asyncpg.Connection, run: list[Firing], now: datetime, batch: BatchAlarms
    ) -> None:
        """Write a run of firings (distinct device and rule) and empty it."""
        if not run:
            return
        requests = [
            AlarmRequest(
                device_id=f.device_id, rule_key=f.rule_key, severity=f.severity,
                telemetry_event_id=f.telemetry_event_id, reason=f.reason,
            )
            for f in run
        ]  # fmt: skip
        creations = await create_alarms(
            conn, requests, node_id=self.node_id, now=now, summary=self.summary
        )
        for firing, creation in zip(run, creations, strict=True):
            if not creation.created or creation.alarm is None:
                batch.deduplicated += 1
                continue
            batch.created.append((firing.rule_key, creation.alarm.id))
            if creation.superseded_id is not None:
                batch.superseded += 1
        run.clear()

    async def _clear(
        self, conn: asyncpg.Connection, clearing: Clearing, now: datetime, batch: BatchAlarms
    ) -> None:
        cleared = await clear_alarm(
            conn, device_id=clearing.device_id, rule_key=clearing.rule_key,
            clear_event_id=clearing.telemetry_event_id, reason=clearing.reason, now=now,
        )  # fmt: skip
        if cleared is not None:
            batch.cleared += 1

    async def _clear_inactivity(
        self,
        conn: asyncpg.Connection,
        rules: RuleSet,
        messages: Sequence[tuple[str, str, Telemetry]],
        now: datetime,
        batch: BatchAlarms,
    ) -> None:
        """Any message clears the device's inactivity alarms, whichever node raised them."""
        if not rules.inactivity_rules:
            return
        first_event: dict[str, str] = {}
        for device_id, event_id, _ in messages:
            first_event.setdefault(device_id, event_id)
        keys, events = [], []
        for device_id, event_id in first_event.items():
            for rule in rules.for_device(device_id):
                if isinstance(rule, InactivityRule):
                    keys.append(active_key(device_id, rule.key))
                    events.append(event_id)
        for row in await repo.clear_many(conn, keys, events, now):
            batch.cleared += 1
            batch.staged.record([StateChange(row["device_id"], row["rule_key"], IDLE)])
            await outbox.add_event(
                conn, aggregate_type="alarm", aggregate_id=str(row["id"]),
                event_type=EVENT_CLEARED,
                payload={"alarm_id": row["id"], "device_id": row["device_id"],
                         "rule_key": row["rule_key"], "status": row["status"],
                         "clear_event_id": row["event_id"], "reason": "device heard from again",
                         "cleared_at": now.isoformat()},
            )  # fmt: skip


def inactivity_event_id(rule_key: str, device_id: str, last_seen: datetime) -> str:
    """The stand-in telemetry event id of an inactivity alarm: derived from stored facts, so
    every node (and a restarted one) computes the same dedup key for the same silence."""
    source = f"inactivity\n{rule_key}\n{device_id}\n{last_seen.isoformat()}".encode()
    return hashlib.sha256(source).hexdigest()
