"""Commands created in tests as the daemon creates them: through the creator's batch
(gateway/commands/creator.py), one command a batch."""

from __future__ import annotations

from typing import Any

import asyncpg

from gateway.commands.creator import Creation, NewCommand, create_commands
from gateway.commands.lifecycle import DeviceUnboundError


async def new_command(
    conn: asyncpg.Connection,
    *,
    node_id: str = "test",
    expire_after_s: float = 3600,
    **fields: Any,
) -> Creation:
    """A new PENDING command (``fields``: :class:`NewCommand`'s; by default no idempotency key
    and the actor ``test``), or the device's existing one with the same idempotency key, in a
    transaction of its own (a savepoint in the caller's); raises :class:`DeviceUnboundError`."""
    command = NewCommand(**{"idempotency_key": None, "actor": "test", **fields})
    async with conn.transaction():
        (answer,) = await create_commands(
            conn, [command], expire_after_s=expire_after_s, node_id=node_id
        )
    if isinstance(answer, DeviceUnboundError):
        raise answer
    return answer
