"""What this client id subscribed to on this broker, remembered in the database.

The gateway's session is persistent and a broker keeps every subscription of a session until
it is removed: after a change of ``topic_prefix`` or ``shared_group`` the old filters would go
on delivering (the old prefix's messages dead-lettered as ``BAD_TOPIC``; with a shared group
turned on, a node still receiving everything through its old plain filter). The session
records each filter before subscribing to it, and unsubscribes at every connect what is
remembered and no longer configured.

It also records whether each filter was proven to deliver there (the session's probe came
back), so that a broker resuming the session with exactly the configured filters, all proven,
is not probed again: the probe would wait behind the backlog the session resumes with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

import asyncpg
import structlog

from storage import subscriptions
from storage.errors import DB_ERRORS

log = structlog.get_logger(__name__)

_WAIT_S: Final = 10.0
_ERRORS: Final[tuple[type[BaseException], ...]] = (*DB_ERRORS, TimeoutError)


class SubscriptionMemory:
    """The filters of one client id on one broker. A database that does not answer costs only
    the clean-up of this connect (logged): it never keeps the node from ingesting."""

    def __init__(self, pool: asyncpg.Pool, *, client_id: str, broker: str) -> None:
        self.pool = pool
        self.client_id = client_id
        self.broker = broker

    async def remember(self, filters: Sequence[str]) -> dict[str, bool] | None:
        """Record ``filters``; everything remembered, each with whether it was proven to
        deliver on this broker (None: the database did not answer)."""
        try:
            async with asyncio.timeout(_WAIT_S), self.pool.acquire() as conn:
                return await subscriptions.remember(conn, self.client_id, self.broker, filters)
        except _ERRORS as exc:
            log.warning("subscriptions_not_remembered", error=repr(exc), broker=self.broker)
            return None

    async def forget(self, filters: Sequence[str]) -> None:
        try:
            async with asyncio.timeout(_WAIT_S), self.pool.acquire() as conn:
                await subscriptions.forget(conn, self.client_id, self.broker, filters)
        except _ERRORS as exc:
            log.warning("subscriptions_not_forgotten", error=repr(exc), broker=self.broker)

    async def prove(self, filters: Sequence[str], *, proven: bool) -> None:
        """``filters`` proven to deliver now, or (``proven`` False) not any more. A database
        that does not answer leaves the record as it was (logged): at worst the next connect
        probes again, or trusts a proof this process could not withdraw; the process itself
        does not (``MqttSession._unproven_since``)."""
        try:
            async with asyncio.timeout(_WAIT_S), self.pool.acquire() as conn:
                await subscriptions.prove(conn, self.client_id, self.broker, filters, proven=proven)
        except _ERRORS as exc:
            log.warning(
                "subscription_proof_not_recorded",
                error=repr(exc),
                broker=self.broker,
                proven=proven,
            )
