"""Alarms for the operator API: reads and people's actions, each in its own short transaction
(the transitions themselves are in gateway/alarms/lifecycle.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import asyncpg

from gateway.alarms.figures import AlarmFigures
from gateway.alarms.lifecycle import AlarmNotFoundError, alarm_from_record, transition
from gateway.domain.alarm import Action, Alarm, AlarmStatus, allowed_actions
from gateway.support.metrics import Metrics
from storage import ai_tasks as ai_repo
from storage import alarms as repo


class AlarmService:
    """Reads and people's actions for the HTTP API, each in its own short transaction."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        node_id: str,
        metrics: Metrics | None = None,
        *,
        figures: AlarmFigures | None = None,
    ) -> None:
        self.pool = pool
        self.node_id = node_id
        self.metrics = metrics
        # The daemon's (reloaded with it); by default one with [alarms.figures]' defaults.
        self.figures = figures or AlarmFigures(pool)

    async def stats(self, window: timedelta) -> dict[str, Any]:
        """The alarm system's figures over the last ``window`` (GET /alarm-stats)."""
        return await self.figures.report(window)

    async def get(self, alarm_id: int) -> Alarm:
        async with self.pool.acquire() as conn:
            record = await repo.get(conn, alarm_id)
        if record is None:
            raise AlarmNotFoundError(alarm_id)
        return alarm_from_record(record)

    async def find(
        self,
        *,
        statuses: list[str] | None = None,
        device_id: str | None = None,
        rule_key: str | None = None,
        open_only: bool = False,
        before_id: int | None = None,
        limit: int = 50,
    ) -> list[Alarm]:
        async with self.pool.acquire() as conn:
            records = await repo.list_alarms(
                conn,
                statuses=statuses,
                device_id=device_id,
                rule_key=rule_key,
                open_only=open_only,
                before_id=before_id,
                limit=limit,
            )
        return [alarm_from_record(r) for r in records]

    async def latest_summary(self, alarm_id: int) -> asyncpg.Record | None:
        async with self.pool.acquire() as conn:
            return await ai_repo.latest_for_alarm(conn, alarm_id)

    async def summaries(self, alarm_id: int) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn:
            if await repo.get(conn, alarm_id) is None:
                raise AlarmNotFoundError(alarm_id)
            return await ai_repo.for_alarm(conn, alarm_id)

    async def allowed(self, alarm_id: int) -> tuple[Alarm, tuple[Action, ...]]:
        alarm = await self.get(alarm_id)
        return alarm, allowed_actions(alarm.status)

    async def audit(self, alarm_id: int) -> list[dict[str, Any]]:
        async with self.pool.acquire() as conn:
            if await repo.get(conn, alarm_id) is None:
                raise AlarmNotFoundError(alarm_id)
            return [dict(r.items()) for r in await repo.audit_of(conn, alarm_id)]

    async def chain(self, alarm_id: int) -> list[Alarm]:
        """Oldest first. A superseded alarm's chain is itself alone (see its superseded_by)."""
        alarm = await self.get(alarm_id)
        if alarm.status is AlarmStatus.SUPERSEDED:
            return [alarm]
        async with self.pool.acquire() as conn:
            return [alarm_from_record(r) for r in await repo.chain(conn, alarm_id)]

    async def act(
        self,
        alarm_id: int,
        action: Action,
        *,
        actor: str,
        note: str | None = None,
        request_id: str | None = None,
        stated_actor: str | None = None,
    ) -> Alarm:
        async with self.pool.acquire() as conn, conn.transaction():
            before = await repo.get(conn, alarm_id)
            changed = await transition(
                conn,
                alarm_id,
                action,
                actor=actor,
                node_id=self.node_id,
                note=note,
                request_id=request_id,
                stated_actor=stated_actor,
            )
        if self.metrics is not None and before is not None:
            self.metrics.count_alarm_transition(before["status"], changed.status.value)
        return changed
