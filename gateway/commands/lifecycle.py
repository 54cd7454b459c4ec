"""The command lifecycle: storage and the pure command domain, wired together.

Every transition is a conditional write with its audit row (and, for terminal outcomes, a
``command.finished`` outbox event) in the same transaction. Receipts are applied in
gateway/commands/receipts.py, the reaper's pass is in gateway/commands/reaper.py; creation
is gateway/commands/creator.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg
import msgspec

from gateway.domain.command import TERMINAL_STATUSES, CommandError, CommandStatus
from protocol.events import Aggregate, CommandFinished, EventType
from storage import commands as repo
from storage import outbox
from storage.commands import CommandRow, MovedCommandRow

AGGREGATE = Aggregate.COMMAND
DISPATCHER_ACTOR = "system:dispatcher"


class CommandNotFoundError(CommandError):
    code = "NOT_FOUND"

    def __init__(self, command_id: int) -> None:
        super().__init__(f"no command {command_id}")
        self.command_id = command_id


class DeviceUnboundError(CommandError):
    code = "DEVICE_UNBOUND"

    def __init__(self, device_id: str) -> None:
        super().__init__(f"device {device_id} is unbound: it takes no commands")
        self.device_id = device_id


class SparkplugWriteRefusedError(CommandError):
    """The command's params are no metric write (``{"value": v}``, docs/commands.md, "Sparkplug
    devices"), and some of its devices are Sparkplug devices: their command could only fail,
    unsent. Refused before anything is created, naming those devices."""

    code = "SPARKPLUG_WRITE_INVALID"

    def __init__(self, device_ids: Sequence[str], reason: str) -> None:
        shown = ", ".join(device_ids[:20]) + (" …" if len(device_ids) > 20 else "")
        super().__init__(
            f"{reason}: {len(device_ids)} Sparkplug device(s) could not be written: {shown}"
        )
        self.device_ids = list(device_ids)
        self.reason = reason


class DownlinkTooLargeError(CommandError):
    """The command's downlink cannot fit the broker's maximum packet size whatever node sends
    it: refused before anything is created."""

    code = "DOWNLINK_TOO_LARGE"

    def __init__(self, device_id: str, size: int, limit: int) -> None:
        super().__init__(
            f"the downlink to {device_id} would be at least {size} bytes, over the broker's"
            f" maximum packet size {limit} ([mqtt] max_packet_size): send smaller params"
        )
        self.device_id = device_id
        self.size = size
        self.limit = limit


class CommandClosedError(CommandError):
    code = "ILLEGAL_TRANSITION"

    def __init__(self, command_id: int, status: str) -> None:
        super().__init__(f"command {command_id} is {status}: it cannot be cancelled")
        self.command_id = command_id
        self.status = status


class CommandChangedError(CommandError):
    """The cancel read the command open, and its conditional write found it changed: someone
    moved it first (another operator's cancel, the device's receipt, a campaign, an unbind, the
    reaper). Losing that race is HTTP 409, as for alarms; nothing is changed."""

    code = "STATUS_CHANGED"

    def __init__(self, command_id: int, status: str, actor: str | None) -> None:
        by = f" by {actor}" if actor else ""
        super().__init__(f"command {command_id} changed meanwhile: already {status}{by}")
        self.command_id = command_id
        self.status = status
        self.actor = actor


def command_to_json(row: CommandRow) -> dict[str, Any]:
    body = {
        k: v
        for k, v in msgspec.structs.asdict(row).items()
        if k not in {"legacy_claim", "previous_status"}
    }
    converted: dict[str, Any] = msgspec.to_builtins(body)
    return converted


async def record_change(
    conn: asyncpg.Connection,
    row: CommandRow,
    *,
    from_status: str | None,
    actor: str,
    action: str,
    node_id: str,
    note: str | None = None,
) -> None:
    await repo.insert_audit(
        conn,
        command_id=row.id,
        actor=actor,
        action=action,
        from_status=from_status,
        to_status=row.status,
        generation=row.claim_generation,
        node_id=node_id,
        note=note,
    )
    if CommandStatus(row.status) in (
        CommandStatus.ACKED,
        CommandStatus.FAILED,
        CommandStatus.TIMEOUT,
        CommandStatus.CANCELLED,
    ):
        await outbox.add_event(
            conn,
            aggregate_type=AGGREGATE,
            aggregate_id=str(row.id),
            event_type=EventType.COMMAND_FINISHED,
            payload=CommandFinished(command=command_to_json(row), actor=actor),
        )


async def mark_sent(
    conn: asyncpg.Connection | asyncpg.Pool,
    row: CommandRow,
    *,
    node_id: str,
    sent_timeout_s: float,
    note: str | None = None,
) -> CommandRow | None:
    """The broker acknowledged the downlink (or may have it: ``note`` says why it is taken as
    sent): CLAIMED → SENT, if the claim is still ours.

    One statement writes the change and its audit row, so it needs no transaction of its own
    (SENT is never terminal: no outbox event).
    """
    return await repo.mark_sent(
        conn,
        command_id=row.id,
        generation=row.claim_generation,
        node_id=node_id,
        timeout_s=sent_timeout_s,
        actor=DISPATCHER_ACTOR,
        note=note,
    )


async def fail_unsendable(
    conn: asyncpg.Connection, row: CommandRow, *, node_id: str, code: str, reason: str
) -> CommandRow | None:
    """The broker can never take this claim's downlink (``code``: ``PACKET_TOO_LARGE``, or the
    name of the PUBACK's final reason code): CLAIMED → FAILED at once, whatever its delivery
    class, with its audit row and ``command.finished`` event, in the caller's transaction. None
    when the claim is not ours any more (its new owner meets the same refusal)."""
    failed = await repo.fail_unsendable(
        conn, row.id, row.claim_generation, node_id=node_id, code=code, reason=reason
    )
    if failed is not None:
        await record_change(
            conn,
            failed,
            from_status="CLAIMED",
            actor=DISPATCHER_ACTOR,
            action="unsendable",
            node_id=node_id,
            note=f"{code}: {reason}",
        )
    return failed


async def cancel(
    conn: asyncpg.Connection, command_id: int, *, actor: str, node_id: str
) -> MovedCommandRow:
    """The cancelled row, with ``previous_status``: the status it left.

    The command is read, then cancelled by a conditional write: one terminal when read raises
    :class:`CommandClosedError` (an illegal action); one the write finds terminal, changed
    meanwhile by someone else, :class:`CommandChangedError` (a lost race). A claim or a PUBACK
    committed meanwhile is no race: the command is still open, and the write says what it left.
    """
    seen = await repo.get(conn, command_id)
    if seen is None:
        raise CommandNotFoundError(command_id)
    if CommandStatus(seen.status) in TERMINAL_STATUSES:
        raise CommandClosedError(command_id, seen.status)
    row = await repo.cancel(conn, command_id)
    if row is None:
        current = await repo.changed_by(conn, command_id)
        if current is None:  # commands are never deleted; a restored backup could do it
            raise CommandNotFoundError(command_id)
        raise CommandChangedError(command_id, *current)
    await record_change(
        conn, row, from_status=row.previous_status, actor=actor, action="cancel", node_id=node_id
    )
    return row


async def unbind(
    conn: asyncpg.Connection, device_id: str, *, actor: str, node_id: str
) -> list[MovedCommandRow]:
    """The device takes no more commands; its open ones are cancelled (each row with
    ``previous_status``)."""
    await repo.unbind_device(conn, device_id)
    cancelled = await repo.cancel_open_of_device(conn, device_id)
    for row in cancelled:
        await record_change(
            conn,
            row,
            from_status=row.previous_status,
            actor=actor,
            action="unbind",
            node_id=node_id,
        )
    return cancelled
