"""Commands created in tests as the daemon creates them: through the creator's batch
(gateway/commands/creator.py), one command a batch."""

from __future__ import annotations

from typing import Any

import asyncpg

from gateway.commands.creator import Creation, NewCommand, create_commands
from gateway.commands.lifecycle import DeviceUnboundError
from gateway.domain.command import Delivery


async def new_command(
    conn: asyncpg.Connection,
    *,
    device_id: str,
    name: str,
    params: dict[str, Any],
    delivery: Delivery,
    idempotency_key: str | None = None,
    actor: str = "test",
    node_id: str = "test",
    expire_after_s: float = 3600,
) -> Creation:
    """A new PENDING command, or the device's existing one with the same idempotency key, in a
    transaction of its own (a savepoint in the caller's); raises :class:`DeviceUnboundError`."""
    command = NewCommand(
        device_id=device_id,
        name=name,
        params=params,
        delivery=delivery,
        idempotency_key=idempotency_key,
        actor=actor,
    )
    async with conn.transaction():
        (answer,) = await create_commands(
            conn, [command], expire_after_s=expire_after_s, node_id=node_id
        )
    if isinstance(answer, DeviceUnboundError):
        raise answer
    return answer
