"""The command routes (behaviour §7, §9), behind the same tokens as the alarm routes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final

import structlog
from litestar import Response
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody, Parameter

from gateway.api.auth import CallDep, Role, actor_of
from gateway.api.errors import (
    COMMAND_CHANGED,
    COMMAND_CLOSED,
    COMMAND_NOT_FOUND,
    DEVICE_ID_NOT_PORTABLE,
    DEVICE_UNBOUND,
    DOWNLINK_TOO_LARGE,
    SPARKPLUG_WRITE_INVALID,
    bad_request,
)
from gateway.api.params import (
    AnyDeviceId,
    AnyDeviceIdFilter,
    Before,
    CommandId,
    CommandStatusFilter,
    DeviceId,
    Limit,
    any_device_id,
    page,
)
from gateway.api.routes import route
from gateway.api.schemas import (
    ANY_DEVICE_ID_PATTERN,
    LIMIT_DEFAULT,
    WAIT_MAX_S,
    CancelledCommand,
    Command,
    CommandBody,
    CommandCreated,
    CommandDetail,
    CommandPage,
    DeviceCommandBody,
    Receipt,
    Unbound,
    exact,
    from_row,
)
from gateway.api.services import Commands
from gateway.commands.lifecycle import (
    CommandChangedError,
    CommandClosedError,
    CommandNotFoundError,
    DeviceUnboundError,
    DownlinkTooLargeError,
    SparkplugWriteRefusedError,
)
from protocol import is_valid_device_id, sparkplug
from protocol.ids import UnportableDeviceIdError
from storage.commands import CommandRow

log = structlog.get_logger(__name__)


TAG: Final = "commands"
Wait = Annotated[
    float | None,
    Parameter(
        ge=0,
        le=WAIT_MAX_S,
        schema_extra=exact("number", minimum=0, maximum=WAIT_MAX_S),
        description=(
            f"Seconds to wait for a terminal status (0 to {WAIT_MAX_S:g}). Without it the call "
            "returns at once."
        ),
    ),
]


_CREATED_AGAIN: Final = {
    200: ResponseSpec(
        data_container=CommandCreated,
        generate_examples=False,
        description=(
            "The idempotency key named an existing command of this device: that command "
            "(`created` false), whatever this request's name and params."
        ),
    )
}
_CREATE_DESCRIPTION: Final = (
    "The command is created PENDING, attributed to the token's name (`created_by`); any "
    "node's dispatcher claims and publishes it. With `wait`, the call returns once the "
    "command is terminal (ACKED, FAILED, TIMEOUT, CANCELLED) or the wait is over, with "
    "the command as it is then: a realtime command's failure comes back in this call. The "
    "gateway reads the command a few times a second while waiting (no connection is held "
    "in between); the status code is 201 or 200 whatever the outcome, which is in "
    "`command.status`."
)


@route(
    "POST",
    "/devices/{id:str}/commands",
    operation_id="createCommand",
    tag=TAG,
    summary="Send a command to the device, optionally waiting for its outcome",
    role=Role.OPERATOR,
    writes=True,
    body=True,
    errors=[DEVICE_ID_NOT_PORTABLE, DEVICE_UNBOUND, DOWNLINK_TOO_LARGE, SPARKPLUG_WRITE_INVALID],
    status_code=201,
    also=_CREATED_AGAIN,
    description=_CREATE_DESCRIPTION
    + " A Sparkplug device, whose id holds `/`, takes its commands through `POST /commands`.",
)
async def create_command(
    commands: Commands,
    call: CallDep,
    id: DeviceId,
    data: JSONBody[CommandBody],
    wait: Wait = None,
) -> Response[CommandCreated]:
    return await _create(commands, call, id, data, wait)


@route(
    "POST",
    "/commands",
    operation_id="createDeviceCommand",
    tag=TAG,
    summary="Send a command to the device named in the body (native or Sparkplug id)",
    role=Role.OPERATOR,
    writes=True,
    body=True,
    errors=[DEVICE_ID_NOT_PORTABLE, DEVICE_UNBOUND, DOWNLINK_TOO_LARGE, SPARKPLUG_WRITE_INVALID],
    status_code=201,
    also=_CREATED_AGAIN,
    description=(
        "The same as `POST /devices/{id}/commands` with the device in the body (`device_id`): "
        "a native id or a Sparkplug one (`{group}/{node}/{device}`, `{group}/{node}` for the "
        "edge node), which a path cannot carry. A `device_id` no device can have is a 422, "
        "as the body's other fields. "
    )
    + _CREATE_DESCRIPTION,
)
async def create_device_command(
    commands: Commands,
    call: CallDep,
    data: JSONBody[DeviceCommandBody],
    wait: Wait = None,
) -> Response[CommandCreated]:
    return await _create(commands, call, data.device_id, data.command(), wait)


async def _create(
    commands: Commands, call: CallDep, device_id: str, data: CommandBody, wait: float | None
) -> Response[CommandCreated]:
    """Both create routes: the command, logged, refused as the service refuses it."""
    try:
        created = await commands.create(
            device_id=device_id,
            name=data.name,
            params=data.params,
            delivery=data.delivery,
            idempotency_key=data.idempotency_key,
            actor=actor_of(call),
        )
    except (
        DeviceUnboundError,
        DownlinkTooLargeError,
        SparkplugWriteRefusedError,
        UnportableDeviceIdError,
    ) as exc:
        log.info(
            "command_create_refused",
            device_id=device_id,
            token=call.caller.name,
            request_id=call.request_id,
            code=getattr(exc, "code", "BAD_DEVICE_ID"),
        )
        raise
    row = created.command
    log.info(
        "command_created" if created.created else "command_create_repeated",
        command_id=row.id,
        device_id=device_id,
        name=data.name,
        delivery=data.delivery.value,
        token=call.caller.name,
        request_id=call.request_id,
        wait_s=wait,
    )
    if wait is not None:
        row = await commands.wait_for(row, wait)
    return Response(
        CommandCreated(command=from_row(Command, row), created=created.created),
        status_code=201 if created.created else 200,
    )


@route(
    "GET",
    "/devices/{id:str}/commands",
    operation_id="listDeviceCommands",
    tag=TAG,
    summary="The device's commands, newest first (keyset pagination by id)",
    role=Role.VIEWER,
)
async def list_commands(
    commands: Commands,
    id: DeviceId,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> CommandPage:
    found = await commands.list(id, before_id=before, limit=limit + 1)
    return _page(found, limit)


@route(
    "GET",
    "/commands",
    operation_id="listCommands",
    tag=TAG,
    summary="The fleet's commands, newest first (keyset pagination by id)",
    role=Role.VIEWER,
    description=(
        "Every device's commands, campaigns' included; `status` keeps one status (e.g. "
        "`FAILED`: what went wrong across the fleet, or `SENT`: what is waiting on devices); "
        "`device` keeps one device's, a native or a Sparkplug id (which "
        "`GET /devices/{id}/commands` cannot name)."
    ),
)
async def list_fleet_commands(
    commands: Commands,
    status: CommandStatusFilter = None,
    device: AnyDeviceIdFilter = None,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> CommandPage:
    wanted = None if status is None else status.value
    if device is None:
        found = await commands.list_all(status=wanted, before_id=before, limit=limit + 1)
    elif is_valid_device_id(device) or sparkplug.is_device_key(device):
        found = await commands.list(device, status=wanted, before_id=before, limit=limit + 1)
    else:  # the pattern's `$` admits a closing "\n" in Python: the protocol's checks decide
        raise bad_request("device", f"must match {ANY_DEVICE_ID_PATTERN}")
    return _page(found, limit)


def _page(found: Sequence[CommandRow], limit: int) -> CommandPage:
    """``found`` was asked for one more than ``limit``: a next page is promised only if it has
    something on it."""
    items, next_before = page(found, limit, lambda r: from_row(Command, r))
    return CommandPage(items=items, next_before=next_before)


_UNBIND: Final = (
    "Later `POST /devices/{id}/commands` (and `POST /commands`) get 409 `DEVICE_UNBOUND`. A "
    "device never seen is registered as unbound. No request body."
)


@route(
    "POST",
    "/devices/{id:str}/unbind",
    operation_id="unbindDevice",
    tag=TAG,
    summary="Unbind the device: it takes no more commands; its open ones are cancelled",
    role=Role.OPERATOR,
    writes=True,
    description=_UNBIND + " A Sparkplug device, whose id holds `/`: `POST /device/unbind?id=`.",
)
async def unbind_device(
    commands: Commands,
    call: CallDep,
    id: DeviceId,
) -> Unbound:
    return await _unbind(commands, call, id)


@route(
    "POST",
    "/device/unbind",
    operation_id="unbindDeviceById",
    tag=TAG,
    summary="Unbind the device named in the query (native or Sparkplug id)",
    role=Role.OPERATOR,
    writes=True,
    description=(
        "`POST /devices/{id}/unbind` for any device, Sparkplug ones included "
        "(`?id=Plant1%2FLine4%2FOven`), whose `/` no path can carry. "
    )
    + _UNBIND,
)
async def unbind_device_by_id(
    commands: Commands,
    call: CallDep,
    id: AnyDeviceId,
) -> Unbound:
    return await _unbind(commands, call, any_device_id(id))


async def _unbind(commands: Commands, call: CallDep, id: str) -> Unbound:
    cancelled = await commands.unbind(id, actor=actor_of(call))
    ids = sorted(r.id for r in cancelled)
    log.info(
        "device_unbound",
        device_id=id,
        cancelled=ids,
        token=call.caller.name,
        request_id=call.request_id,
    )
    return Unbound(device_id=id, cancelled=ids)


@route(
    "GET",
    "/commands/{id:str}",
    operation_id="getCommand",
    tag=TAG,
    summary="One command with its receipts",
    role=Role.VIEWER,
    errors=[COMMAND_NOT_FOUND],
)
async def get_command(commands: Commands, id: CommandId) -> CommandDetail:
    row, receipts = await commands.get(id)
    return CommandDetail(
        command=from_row(Command, row), receipts=[from_row(Receipt, r) for r in receipts]
    )


@route(
    "POST",
    "/commands/{id:str}/cancel",
    operation_id="cancelCommand",
    tag=TAG,
    summary="Cancel the command (PENDING, CLAIMED or SENT → CANCELLED)",
    role=Role.OPERATOR,
    writes=True,
    errors=[COMMAND_NOT_FOUND, COMMAND_CLOSED, COMMAND_CHANGED],
    description=(
        "The command is read, then cancelled by a conditional write: of concurrent cancels "
        "exactly one wins. A command terminal when read is 400 `ILLEGAL_TRANSITION`; one that "
        "turned terminal between the read and the write (another operator's cancel, the "
        "device's receipt, a campaign, an unbind, the reaper) is 409 `STATUS_CHANGED` with "
        "its `current_status` and the `actor` of that change. The answer says the status the "
        "command left (`previous_status`): one that left `CLAIMED` or `SENT` may have reached "
        "the device and may still run there. No request body."
    ),
)
async def cancel_command(
    commands: Commands,
    call: CallDep,
    id: CommandId,
) -> CancelledCommand:
    try:
        row = await commands.cancel(id, actor=actor_of(call))
    except (CommandNotFoundError, CommandClosedError, CommandChangedError) as exc:
        log.info(
            "command_cancel_refused",
            command_id=id,
            token=call.caller.name,
            request_id=call.request_id,
            code=exc.code,
        )
        raise
    log.info(
        "command_cancelled",
        command_id=id,
        device_id=row.device_id,
        previous_status=row.previous_status,
        token=call.caller.name,
        request_id=call.request_id,
    )
    return from_row(CancelledCommand, row)


HANDLERS: Final = [
    create_command,
    create_device_command,
    list_commands,
    list_fleet_commands,
    unbind_device,
    unbind_device_by_id,
    get_command,
    cancel_command,
]
