"""What the API does with notifications: silences (create, list, expire) and deliveries
(list, one)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg

from gateway.domain.errors import GatewayError
from gateway.domain.notify_match import compile_matchers
from storage import notify as repo


class SilenceNotFoundError(GatewayError):
    def __init__(self, silence_id: int) -> None:
        super().__init__(f"no silence {silence_id}")
        self.silence_id = silence_id


class DeliveryNotFoundError(GatewayError):
    def __init__(self, delivery_id: int) -> None:
        super().__init__(f"no delivery {delivery_id}")
        self.delivery_id = delivery_id


class NotifyService:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def create_silence(
        self,
        *,
        rules: list[str] | None,
        devices: str | list[str] | None,
        severities: list[str] | None,
        ends_at: datetime,
        comment: str,
        created_by: str,
    ) -> asyncpg.Record:
        """Validated like a route's matchers (a `ConfigError` names the field)."""
        compile_matchers(rules=rules, devices=devices, severities=severities, path="matchers")
        matchers: dict[str, Any] = {}
        if rules is not None:
            matchers["rules"] = rules
        if devices is not None:
            matchers["devices"] = devices
        if severities is not None:
            matchers["severities"] = severities
        return await repo.insert_silence(
            self.pool, matchers=matchers, ends_at=ends_at, comment=comment, created_by=created_by
        )

    async def silences(
        self, *, active_only: bool, before: int | None, limit: int
    ) -> list[asyncpg.Record]:
        return await repo.list_silences(
            self.pool, active_only=active_only, before=before, limit=limit
        )

    async def expire_silence(self, silence_id: int, by: str) -> asyncpg.Record:
        """End the silence now (one already over is returned as it is)."""
        async with self.pool.acquire() as conn:
            await repo.expire_silence(conn, silence_id, by)
            row = await repo.get_silence(conn, silence_id)
        if row is None:
            raise SilenceNotFoundError(silence_id)
        return row

    async def deliveries(
        self,
        *,
        status: str | None,
        receiver: str | None,
        event: str | None,
        before: int | None,
        limit: int,
    ) -> list[asyncpg.Record]:
        return await repo.list_deliveries(
            self.pool, status=status, receiver=receiver, event=event, before=before, limit=limit
        )

    async def delivery(self, delivery_id: int) -> asyncpg.Record:
        row = await repo.get_delivery(self.pool, delivery_id)
        if row is None:
            raise DeliveryNotFoundError(delivery_id)
        return row
