"""Creating commands (a campaign's, or one through the API) racing an unbind of a target device,
against real PostgreSQL: once both have committed, the unbound device has no open command.

The creation reads which targets are unbound, then inserts. An unbind committed between the two
used to find nothing to cancel (the new commands were not committed yet), and the creation then
committed a PENDING command for a device that takes none: it was dispatched. The interleaving is
forced: another transaction holds the creation's idempotency key uncommitted, so the creation's
insert waits on it after its read, while the unbind is run; then that key is let go.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import pytest
from asyncpg.transaction import Transaction

from gateway.commands.campaigns import (
    CampaignRequest,
    CampaignService,
    Targets,
    UnboundTargetsError,
)
from gateway.commands.lifecycle import DeviceUnboundError, unbind
from gateway.commands.service import CommandService
from gateway.domain.command import Delivery
from storage.commands import MovedCommandRow
from tests.support.waiting import wait_until

DEVICES = ("pump-1", "pump-2", "pump-3")
INSERT_COMMAND = "INSERT INTO command (device_id, name, params, delivery, idempotency_key"


async def _known(conn: asyncpg.Connection) -> None:
    await conn.execute(
        "INSERT INTO device (device_id, first_seen, last_seen, bound)"
        " SELECT d, now(), now(), true FROM unnest($1::text[]) AS d",
        list(DEVICES),
    )


async def _waiting_on_lock(pool: asyncpg.Pool, query_part: str) -> bool:
    n = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database() AND query LIKE $1",
        "%" + query_part + "%",
    )
    return bool(n)


async def _open_commands_of(pool: asyncpg.Pool, device_id: str) -> list[str]:
    rows = await pool.fetch(
        "SELECT status FROM command WHERE device_id = $1"
        " AND status IN ('PENDING', 'CLAIMED', 'SENT')",
        device_id,
    )
    return [r["status"] for r in rows]


async def _unbind_then_release(
    pool: asyncpg.Pool, commands: CommandService, held: Transaction
) -> asyncio.Task[list[MovedCommandRow]]:
    """While a creation waits for the key ``held`` holds: pump-2 unbound, the unbind either
    committed (no lock to wait for) or waiting for the creation; then the key released."""
    unbinding = asyncio.create_task(commands.unbind("pump-2", actor="api:ops"))
    await wait_until(
        lambda: unbinding.done() or _waiting_on_lock(pool, "FROM device"),
        timeout=10, message="the unbind committed or waits",
    )  # fmt: skip
    await held.rollback()
    return unbinding


@pytest.mark.parametrize("by_selector", [False, True], ids=["devices", "selector"])
async def test_a_device_unbound_while_a_campaign_is_created_gets_no_open_command(
    pool: asyncpg.Pool, db_dsn: str, by_selector: bool
) -> None:
    async with pool.acquire() as conn:
        await _known(conn)
    campaigns = CampaignService(pool, "api", 3600.0)
    commands = CommandService(pool, "api", 3600.0)
    targets = Targets(selector=("pump-*",)) if by_selector else Targets(devices=DEVICES)
    request = CampaignRequest(
        name="reboot", params={}, delivery=Delivery.REALTIME, targets=targets,
        per_minute=None, abort=None, idempotency_key="push-1",
    )  # fmt: skip
    holder = await asyncpg.connect(db_dsn)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute(
            "INSERT INTO campaign (name, device_ids, target_devices, idempotency_key,"
            " created_by) VALUES ('other', '{x}', '{x}', 'push-1', 'test')"
        )
        creating = asyncio.create_task(campaigns.create(request, actor="api:ops"))
        # Past its read of the targets, its insert waits for the key held here.
        await wait_until(
            lambda: _waiting_on_lock(pool, "INSERT INTO campaign (name"),
            timeout=10, message="the campaign's insert waits for the key",
        )  # fmt: skip
        unbinding = await _unbind_then_release(pool, commands, held)
        created = await asyncio.wait_for(creating, timeout=20)
        await asyncio.wait_for(unbinding, timeout=20)
    finally:
        await holder.close()
    assert created.created
    assert await _open_commands_of(pool, "pump-2") == []
    for other in ("pump-1", "pump-3"):
        assert await _open_commands_of(pool, other) == ["PENDING"]


async def test_a_device_unbound_while_its_command_is_created_gets_no_open_command(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    async with pool.acquire() as conn:
        await _known(conn)
    commands = CommandService(pool, "api", 3600.0)
    holder = await asyncpg.connect(db_dsn)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute(
            "INSERT INTO command (device_id, name, params, delivery, idempotency_key,"
            " created_by, expire_at) VALUES ('pump-2', 'other', '{}', 'realtime', 'k-1',"
            " 'test', now() + interval '1 hour')"
        )
        creating = asyncio.create_task(
            commands.create(
                device_id="pump-2",
                name="open_valve",
                params={},
                delivery=Delivery.REALTIME,
                idempotency_key="k-1",
                actor="api:ops",
            )
        )
        await wait_until(
            lambda: _waiting_on_lock(pool, INSERT_COMMAND),
            timeout=10, message="the command's insert waits for the key",
        )  # fmt: skip
        unbinding = await _unbind_then_release(pool, commands, held)
        with contextlib.suppress(DeviceUnboundError):  # refused: as good as cancelled
            await asyncio.wait_for(creating, timeout=20)
        await asyncio.wait_for(unbinding, timeout=20)
    finally:
        await holder.close()
    assert await _open_commands_of(pool, "pump-2") == []


async def test_a_campaign_created_while_an_unbind_is_in_flight_reads_it_unbound(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """The other order: the unbind's transaction is open when the campaign reads its targets."""
    async with pool.acquire() as conn:
        await _known(conn)
    campaigns = CampaignService(pool, "api", 3600.0)
    request = CampaignRequest(
        name="reboot", params={}, delivery=Delivery.REALTIME, targets=Targets(devices=DEVICES),
        per_minute=None, abort=None, idempotency_key=None,
    )  # fmt: skip
    unbinder = await asyncpg.connect(db_dsn)
    try:
        held = unbinder.transaction()
        await held.start()
        await unbind(unbinder, "pump-2", actor="api:ops", node_id="api")
        creating = asyncio.create_task(campaigns.create(request, actor="api:ops"))
        await wait_until(
            lambda: creating.done() or _waiting_on_lock(pool, "FROM device"),
            timeout=10, message="the campaign was created or waits",
        )  # fmt: skip
        await held.commit()
        with contextlib.suppress(UnboundTargetsError):  # refused: nothing created
            await asyncio.wait_for(creating, timeout=20)
    finally:
        await unbinder.close()
    assert await _open_commands_of(pool, "pump-2") == []
