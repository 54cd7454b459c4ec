"""Inactivity alarms: devices not heard from for ``silent_seconds`` (or offline).

Derived from ``device.last_seen`` / presence in the database, not from timers, so the
decision survives restarts and is the same on every node: the dedup key of the alarm is
computed from the stored silence, and whoever commits first raises it.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

import asyncpg
import structlog

from gateway.alarms.engine import AlarmEngine, inactivity_event_id
from gateway.alarms.service import ConcurrentWriteError, create_alarm
from gateway.domain.rules import InactivityRule, silence_trigger
from gateway.support.loops import every
from storage import alarms as repo

log = structlog.get_logger(__name__)


class InactivityMonitor:
    def __init__(self, *, pool: asyncpg.Pool, engine: AlarmEngine, interval_s: float) -> None:
        self.pool = pool
        self.engine = engine
        self.interval_s = interval_s

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.interval_s, stop, self.run_once, name="inactivity")

    async def run_once(self) -> list[int]:
        """Raise the inactivity alarms due now; the ids raised by this call."""
        raised: list[int] = []
        for rule in self.engine.rules.inactivity_rules:
            async with self.pool.acquire() as conn:
                silent = await repo.silent_devices(conn, rule.silent_seconds, rule.key)
            for device in silent:
                device_id = device["device_id"]
                if not rule.selector.matches(device_id):
                    continue
                since = device["last_seen"]
                if device["presence"] == "offline" and device["presence_at"] >= since:
                    since = device["presence_at"]
                    reason = "presence offline"
                else:
                    reason = f"silent for more than {rule.silent_seconds:g}s"
                alarm_id = await self._raise(rule, device_id, since, reason)
                if alarm_id is not None:
                    raised.append(alarm_id)
        return raised

    async def _raise(
        self, rule: InactivityRule, device_id: str, since: datetime, reason: str
    ) -> int | None:
        rule_key = rule.key
        event_id = inactivity_event_id(rule_key, device_id, since)
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                now = await repo.db_now(conn)
                creation = await create_alarm(
                    conn,
                    device_id=device_id,
                    rule_key=rule_key,
                    severity=rule.severity,
                    telemetry_event_id=event_id,
                    reason=reason,
                    node_id=self.engine.node_id,
                    now=now,
                    summary=self.engine.summary,
                    trigger=silence_trigger(since),
                    rule_description=rule.description,
                )
        except ConcurrentWriteError:
            return None  # another node raised it first
        if creation.alarm is None:
            return None
        self.engine.metrics.alarms_created.labels(rule_key).inc()
        log.info("alarm_created", alarm_id=creation.alarm.id, rule_key=rule_key, reason=reason)
        return creation.alarm.id
