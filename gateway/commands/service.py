"""Commands for the operator API (behaviour §7, §9): each call one transaction on a pooled
connection, except creation, where concurrent requests share one (gateway/commands/creator.py).

``wait_for`` may wait for the outcome. Nothing notifies terminal states (``command_due`` fires
only for PENDING rows), so the wait polls the one row by its primary key: 50 ms apart at first,
backing off to 0.5 s, each read on a pooled connection taken for that read alone. A waiting
request holds no connection between reads, so waiters cannot starve the pool; the daemon's stop
event ends every wait at once, so shutdown never waits for them. A read that fails (database
unreachable) does not end the wait: the command exists already, and at the deadline the caller
gets it as last read rather than a 503 without its id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Final

import asyncpg
import structlog

from gateway.commands.creator import CommandCreator, Creation, NewCommand
from gateway.commands.dispatcher import smallest_downlink
from gateway.commands.lifecycle import (
    CommandNotFoundError,
    DownlinkTooLargeError,
    SparkplugWriteRefusedError,
    cancel,
    unbind,
)
from gateway.commands.sparkplug import SparkplugWriteError, write_of
from gateway.domain.command import TERMINAL_STATUSES, CommandStatus, Delivery
from gateway.support.loops import sleep_unless_stopped
from gateway.support.metrics import Metrics
from protocol import Topics, sparkplug
from storage import commands as repo
from storage.commands import CommandRow, MovedCommandRow
from storage.errors import TRANSIENT_DB_ERRORS
from storage.pool import bound_lock_wait

log = structlog.get_logger(__name__)

POLL_FIRST_S: Final = 0.05
POLL_MAX_S: Final = 0.5
POLL_GROWTH: Final = 1.25
# One poll's read may not stretch the wait by more than this (a pool waiting to connect).
READ_TIMEOUT_S: Final = 2.0
_UNREADABLE: Final = TRANSIENT_DB_ERRORS


class CommandService:
    """Commands for the API: each call one transaction on a pooled connection (creations
    arriving together share one)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        node_id: str,
        expire_after_s: float,
        *,
        stop: asyncio.Event | None = None,
        metrics: Metrics | None = None,
        topics: Topics | None = None,
        max_packet_size: int = 0,
        mqtt5: bool = True,
    ) -> None:
        self.pool = pool
        # [mqtt] max_packet_size (0: none): a command whose downlink cannot fit it is refused.
        self.topics = topics or Topics("iot")
        self.max_packet_size = max_packet_size
        self.mqtt5 = mqtt5
        self.node_id = node_id
        self.expire_after_s = expire_after_s
        # Set by the daemon on shutdown: every wait returns at once with what it has.
        self.stop = stop or asyncio.Event()
        self.metrics = metrics
        self.creator = CommandCreator(pool, node_id, expire_after_s, metrics=metrics)

    async def create(
        self,
        *,
        device_id: str,
        name: str,
        params: dict[str, Any],
        delivery: Delivery,
        idempotency_key: str | None,
        actor: str,
    ) -> Creation:
        """Raises (nothing created) what :meth:`refuse_unsendable` raises, or what the creator
        raises."""
        self.refuse_unsendable((device_id,), name, params)
        return await self.creator.create(
            NewCommand(
                device_id=device_id,
                name=name,
                params=params,
                delivery=delivery,
                idempotency_key=idempotency_key,
                actor=actor,
            )
        )

    def refuse_unsendable(
        self, device_ids: Sequence[str], name: str, params: dict[str, Any]
    ) -> None:
        """Raises :class:`UnportableDeviceIdError` for the first id the broker would not carry
        (``[mqtt] broker_family``), :class:`DownlinkTooLargeError` when the command's downlink
        to one of the devices cannot fit ``max_packet_size`` whatever its claim,
        :class:`SparkplugWriteRefusedError` naming the Sparkplug devices among them when the
        params are no metric write: what can never be sent is refused before anything is
        created (a command, a campaign's)."""
        # The API checked the ids' grammar; built only when a check needs it, a topic cannot
        # refuse a value the database's constraint should (and the creator isolates).
        # A Sparkplug device's command is a metric write, not a native downlink
        # (commands/sparkplug.py): the native topic's checks are not its own.
        native = [d for d in device_ids if not sparkplug.is_device_key(d)]
        if len(native) < len(device_ids):
            # Its params must be a write whatever the birth says (the datatype's range, the
            # metric, the birth itself are the dispatcher's to judge, when it sends).
            try:
                write_of(name, params)
            except SparkplugWriteError as exc:
                writes = [d for d in device_ids if sparkplug.is_device_key(d)]
                raise SparkplugWriteRefusedError(writes, exc.reason) from None
        if self.topics.portable_ids:
            for device_id in native:
                self.topics.commands(device_id)
        if native and self.max_packet_size:
            # The downlinks differ in their topic alone, which grows with the id (ASCII): the
            # longest id's is the largest.
            longest = max(native, key=len)
            topic = self.topics.commands(longest)
            size = smallest_downlink(topic, name, params, mqtt5=self.mqtt5)
            if size > self.max_packet_size:
                raise DownlinkTooLargeError(longest, size, self.max_packet_size)

    async def get(self, command_id: int) -> tuple[CommandRow, list[asyncpg.Record]]:
        """The command and every receipt for it, read in one snapshot."""
        async with (
            self.pool.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            row = await repo.get(conn, command_id)
            if row is None:
                raise CommandNotFoundError(command_id)
            return row, await repo.receipts_of(conn, command_id)

    async def cancel(self, command_id: int, *, actor: str) -> MovedCommandRow:
        async with self.pool.acquire() as conn, conn.transaction():
            # A command a stopped node holds: give up (503), not take a pooled connection.
            await bound_lock_wait(conn)
            row = await cancel(conn, command_id, actor=actor, node_id=self.node_id)
        self._count([row])
        return row

    async def unbind(self, device_id: str, *, actor: str) -> list[MovedCommandRow]:
        async with self.pool.acquire() as conn, conn.transaction():
            await bound_lock_wait(conn)
            cancelled = await unbind(conn, device_id, actor=actor, node_id=self.node_id)
        self._count(cancelled)
        return cancelled

    def _count(self, changed: Sequence[MovedCommandRow]) -> None:
        """Count committed status changes (rows carrying the ``previous_status`` they left)."""
        if self.metrics is not None:
            for row in changed:
                self.metrics.count_command(row.previous_status, row.status)

    async def wait_terminal(self, command_id: int, timeout_s: float) -> CommandRow:
        """The command once terminal, or as it is when ``timeout_s`` ends (or stop is set)."""
        row, _ = await self.get(command_id)
        return await self.wait_for(row, timeout_s)

    async def wait_for(self, row: CommandRow, timeout_s: float) -> CommandRow:
        """Like :meth:`wait_terminal`, starting from ``row`` as already read."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        interval = POLL_FIRST_S
        failures = 0
        while CommandStatus(row.status) not in TERMINAL_STATUSES:
            remaining = deadline - loop.time()
            if remaining <= 0 or self.stop.is_set():
                break
            await sleep_unless_stopped(self.stop, min(interval, remaining))
            interval = min(interval * POLL_GROWTH, POLL_MAX_S)
            try:
                async with asyncio.timeout(READ_TIMEOUT_S), self.pool.acquire() as conn:
                    fresh = await repo.get(conn, row.id)
            except _UNREADABLE as exc:
                failures += 1
                if failures == 1:
                    log.warning("command_wait_read_failed", command_id=row.id, error=repr(exc))
                continue
            if fresh is None:  # commands are never deleted; a restored backup could do it
                raise CommandNotFoundError(row.id)
            row = fresh
        return row

    async def list(
        self, device_id: str, *, before_id: int | None, limit: int, status: str | None = None
    ) -> Sequence[CommandRow]:
        """The device's commands, newest first, with ids below ``before_id``; of one status."""
        async with self.pool.acquire() as conn:
            return await repo.list_for_device(
                conn, device_id, before_id=before_id, limit=limit, status=status
            )

    async def list_all(
        self, *, status: str | None, before_id: int | None, limit: int
    ) -> Sequence[CommandRow]:
        """The fleet's commands, newest first, with ids below ``before_id``; of one status."""
        async with self.pool.acquire() as conn:
            return await repo.list_all(conn, status=status, before_id=before_id, limit=limit)
