"""The campaign routes (behaviour §7): one request commanding many devices."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Final

import msgspec
import structlog
from litestar import Response
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Schema
from litestar.openapi.spec.enums import OpenAPIType
from litestar.params import JSONBody, Parameter
from msgspec import UNSET, UnsetType

from gateway.api.auth import CallDep, Role, actor_of
from gateway.api.errors import (
    CAMPAIGN_CHANGED,
    CAMPAIGN_CLOSED,
    CAMPAIGN_NOT_FOUND,
    DEVICE_ID_NOT_PORTABLE,
    DOWNLINK_TOO_LARGE,
    NO_TARGETS,
    SPARKPLUG_WRITE_INVALID,
    TARGETS_UNBOUND,
    bad_request,
)
from gateway.api.params import Before, CampaignId, CommandStatusFilter, Limit, page
from gateway.api.routes import route
from gateway.api.schemas import (
    ANY_DEVICE_ID_MAX_LENGTH,
    ANY_DEVICE_ID_PATTERN,
    ANY_DEVICE_SELECTOR_MAX_LENGTH,
    ANY_DEVICE_SELECTOR_PATTERN,
    ANY_SELECTOR_PATTERN,
    LIMIT_DEFAULT,
    SELECTOR_ITEMS_MAX,
    Command,
    CommandName,
    IdempotencyKey,
    Params,
    exact,
    from_row,
)
from gateway.api.schemas import (
    CommandBody as _CommandBody,
)
from gateway.api.services import Commands
from gateway.commands.campaigns import (
    CampaignChangedError,
    CampaignClosedError,
    CampaignNotFoundError,
    CampaignRequest,
    CampaignService,
    NoTargetsError,
    Targets,
    UnboundTargetsError,
    counts_of,
)
from gateway.commands.lifecycle import DownlinkTooLargeError, SparkplugWriteRefusedError
from gateway.commands.service import CommandService
from gateway.domain.campaign import AbortCriteria, CampaignStatus
from gateway.domain.command import Delivery
from gateway.domain.errors import ConfigError
from gateway.domain.rules import device_selector
from protocol import is_valid_device_id, sparkplug
from protocol.ids import UnportableDeviceIdError
from storage.campaigns import CampaignRow, CountedCampaignRow

log = structlog.get_logger(__name__)

TAG: Final = "campaigns"
TARGETS_MAX: Final = 50_000
PER_MINUTE_MAX: Final = 1_000_000
MIN_FINISHED_MAX: Final = TARGETS_MAX
SELECTOR_MAX: Final = 100

# A target is any device that takes commands: a native id, or a Sparkplug one (`{group}/{node}`
# for an edge node, `{group}/{node}/{device}`), whose command is its metric write
# (docs/commands.md, "Sparkplug devices"); a selector's glob may cross the levels (`Plant1/*`),
# as the rules' do.
DeviceId = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=ANY_DEVICE_ID_MAX_LENGTH, pattern=ANY_DEVICE_ID_PATTERN),
]
SelectorPattern = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=ANY_DEVICE_SELECTOR_MAX_LENGTH,
        pattern=ANY_DEVICE_SELECTOR_PATTERN,
        description="A device id (native or Sparkplug) or an fnmatch glob (`*`, `?`, `[...]`), "
        "as in the rules.",
    ),
]


class TargetsBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Exactly one of ``devices`` (ids) and ``selector`` (the rules' device selector: one
    pattern or a list; resolved against the known bound devices when the campaign starts)."""

    devices: Annotated[list[DeviceId], msgspec.Meta(max_length=TARGETS_MAX)] | UnsetType = UNSET
    selector: (
        SelectorPattern
        | Annotated[list[SelectorPattern], msgspec.Meta(min_length=1, max_length=SELECTOR_MAX)]
        | UnsetType
    ) = UNSET

    def __post_init__(self) -> None:
        if (self.devices is UNSET) == (self.selector is UNSET):
            raise ValueError("targets: give exactly one of `devices` and `selector`")
        if not isinstance(self.devices, UnsetType):
            # The pattern's `$` admits a closing "\n" in Python: the protocol's checks decide.
            for index, device in enumerate(self.devices):
                if not is_valid_device_id(device) and not sparkplug.is_device_key(device):
                    raise ValueError(
                        f"targets.devices[{index}]: must match {ANY_DEVICE_ID_PATTERN}"
                    )
        if not isinstance(self.selector, UnsetType):
            try:
                device_selector(self.selector, "targets.selector")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None


# JSON has one kind of number, and JSON Schema's `integer` is any number without a fraction:
# `60.0` is one (generators send it). A count in a body is therefore read as a number that is a
# multiple of 1 (msgspec's `int` refuses `60.0`) and becomes an int where it is used; the
# document calls it an `integer` (`complete`). `1.5` is still a 422.
PerMinute = Annotated[float, msgspec.Meta(ge=1, le=PER_MINUTE_MAX, multiple_of=1)]
MinFinished = Annotated[float, msgspec.Meta(ge=1, le=MIN_FINISHED_MAX, multiple_of=1)]


class RolloutBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    per_minute: PerMinute


class AbortBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    failure_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)]
    min_finished: MinFinished


class CampaignBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /campaigns``: one command for many devices, at a pace, with a way out."""

    name: CommandName
    targets: TargetsBody
    params: Params = msgspec.field(default_factory=dict)
    delivery: Delivery = Delivery.REALTIME
    rollout: RolloutBody | None = None
    abort: AbortBody | None = None
    idempotency_key: IdempotencyKey | None = None

    def __post_init__(self) -> None:
        # The same checks as a single command's params (U+0000, size): reuse them.
        _CommandBody(name=self.name, params=self.params)


class Campaign(msgspec.Struct, kw_only=True):
    """A campaign with its commands' ``counts`` per status (every status, zeros included) and
    their ``total``, read in one statement. ``target_devices`` or ``target_selector`` is what
    was asked; the commands list the devices they resolved to."""

    id: int
    name: str
    params: dict[str, Any]
    delivery: Delivery
    status: CampaignStatus
    target_devices: list[str] | None
    target_selector: list[str] | None
    per_minute: int | None
    failure_ratio: float | None
    min_finished: int | None
    idempotency_key: str | None
    created_by: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    status_reason: str | None
    total: int
    counts: dict[str, int]


class CampaignTargets(msgspec.Struct, kw_only=True):
    """What a selector picks now: ``count`` devices (known and bound: a campaign started now
    commands exactly these), the first of them by id in ``sample``."""

    selector: list[str]
    count: int
    sample: list[str]


class CampaignCreatedBody(msgspec.Struct, kw_only=True):
    campaign: Campaign
    created: bool  # false when the idempotency key named an existing campaign


class CampaignPage(msgspec.Struct, kw_only=True):
    items: list[Campaign]
    next_before: int | None = None


class CampaignCommandPage(msgspec.Struct, kw_only=True):
    items: list[Command]
    next_before: int | None = None


def campaign_of(row: CampaignRow, *, with_counts: bool = True) -> Campaign:
    values = msgspec.structs.asdict(row)
    values["total"] = len(values.pop("device_ids"))
    values["counts"] = counts_of(row) if isinstance(row, CountedCampaignRow) and with_counts else {}
    return from_row(Campaign, values)


def _service(commands: CommandService) -> CampaignService:
    """The campaign service on the command service's pool and node (stateless: cheap)."""
    return CampaignService(
        commands.pool,
        commands.node_id,
        commands.expire_after_s,
        metrics=commands.metrics,
        refuse_unsendable=commands.refuse_unsendable,
    )


StatusFilter = Annotated[
    CampaignStatus | None, Parameter(description="Only campaigns in this status.")
]


@route(
    "POST",
    "/campaigns",
    operation_id="createCampaign",
    tag=TAG,
    summary="Command many devices at once, with an optional rollout rate and abort criteria",
    role=Role.OPERATOR,
    writes=True,
    body=True,
    errors=[
        TARGETS_UNBOUND,
        NO_TARGETS,
        DOWNLINK_TOO_LARGE,
        DEVICE_ID_NOT_PORTABLE,
        SPARKPLUG_WRITE_INVALID,
    ],
    status_code=201,
    also={
        200: ResponseSpec(
            data_container=CampaignCreatedBody,
            generate_examples=False,
            description="The idempotency key named an existing campaign: that campaign.",
        )
    },
    description=(
        "Every target gets one ordinary PENDING command (visible in `GET /commands/{id}` with "
        "`campaign_id`), all created in this request's transaction. `rollout.per_minute` caps "
        "how many of them leave PENDING per minute across all nodes; `abort` aborts the "
        "campaign (its open commands CANCELLED) once `min_finished` commands are terminal and "
        "the FAILED + TIMEOUT share reaches `failure_ratio`. A selector is resolved against "
        "the known devices that are bound, when the campaign starts. A campaign with a target "
        "the broker could never carry the command to (its downlink over the maximum packet "
        "size, an id it cannot carry) is refused as `POST /devices/{id}/commands` would "
        "refuse that command, nothing created."
    ),
)
async def create_campaign(
    commands: Commands, call: CallDep, data: JSONBody[CampaignBody]
) -> Response[CampaignCreatedBody]:
    selector = None if isinstance(data.targets.selector, UnsetType) else data.targets.selector
    devices = None if isinstance(data.targets.devices, UnsetType) else data.targets.devices
    request = CampaignRequest(
        name=data.name,
        params=data.params,
        delivery=data.delivery,
        targets=Targets(
            devices=None if devices is None else tuple(devices),
            selector=None
            if selector is None
            else ((selector,) if isinstance(selector, str) else tuple(selector)),
        ),
        per_minute=None if data.rollout is None else int(data.rollout.per_minute),
        abort=None
        if data.abort is None
        else AbortCriteria(data.abort.failure_ratio, int(data.abort.min_finished)),
        idempotency_key=data.idempotency_key,
    )
    try:
        created = await _service(commands).create(
            request, actor=actor_of(call), request_id=call.request_id
        )
    except (
        UnboundTargetsError,
        NoTargetsError,
        DownlinkTooLargeError,
        SparkplugWriteRefusedError,
        UnportableDeviceIdError,
    ) as exc:
        log.info(
            "campaign_create_refused",
            token=call.caller.name,
            request_id=call.request_id,
            code=getattr(exc, "code", DEVICE_ID_NOT_PORTABLE.code),
        )
        raise
    row = created.campaign
    log.info(
        "campaign_created" if created.created else "campaign_create_repeated",
        campaign_id=row.id,
        name=data.name,
        total=len(row.device_ids),
        per_minute=request.per_minute,
        token=call.caller.name,
        request_id=call.request_id,
    )
    return Response(
        CampaignCreatedBody(campaign=campaign_of(row), created=created.created),
        status_code=201 if created.created else 200,
    )


TARGETS_SAMPLE: Final = 20


@route(
    "GET",
    "/campaigns/targets",
    operation_id="countCampaignTargets",
    tag=TAG,
    summary="How many devices a selector picks now: the targets a campaign would command",
    role=Role.VIEWER,
    description=(
        "Resolves the selector exactly as `POST /campaigns` does when a campaign starts "
        "(the known devices that are bound), without creating anything: `count`, and the "
        f"first {TARGETS_SAMPLE} device ids in `sample`. Devices that appear or are unbound "
        "between this answer and the campaign's start change what the campaign commands."
    ),
)
async def count_campaign_targets(
    commands: Commands,
    selector: Annotated[
        str,
        Parameter(
            pattern=ANY_SELECTOR_PATTERN,
            schema_extra=exact("string"),
            description=(
                "The rules' device selector: device ids and globs (`*`, `?`, `[...]`, "
                f"`[!...]`), comma-separated, e.g. `door-*,pump-1`, Sparkplug ids and globs "
                f"across their levels too (`Plant1/*`); at most {SELECTOR_ITEMS_MAX} of them, "
                "each a device id or a glob of at most 64 characters."
            ),
        ),
    ],
) -> CampaignTargets:
    patterns = selector.split(",")
    try:
        device_selector(patterns, "selector")
    except ConfigError as exc:
        raise bad_request("selector", exc.message) from None
    found = await _service(commands).matching(patterns)
    return CampaignTargets(selector=patterns, count=len(found), sample=found[:TARGETS_SAMPLE])


@route(
    "GET",
    "/campaigns",
    operation_id="listCampaigns",
    tag=TAG,
    summary="Campaigns, newest first (keyset pagination by id), without counts",
    role=Role.VIEWER,
    description="`counts` is empty here: `GET /campaigns/{id}` has them.",
)
async def list_campaigns(
    commands: Commands,
    status: StatusFilter = None,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> CampaignPage:
    found = await _service(commands).page(status=status, before_id=before, limit=limit + 1)
    items, next_before = page(found, limit, lambda r: campaign_of(r, with_counts=False))
    return CampaignPage(items=items, next_before=next_before)


@route(
    "GET",
    "/campaigns/{id:str}",
    operation_id="getCampaign",
    tag=TAG,
    summary="One campaign with its count of commands per status",
    role=Role.VIEWER,
    errors=[CAMPAIGN_NOT_FOUND],
)
async def get_campaign(commands: Commands, id: CampaignId) -> Campaign:
    return campaign_of(await _service(commands).get(id))


@route(
    "GET",
    "/campaigns/{id:str}/commands",
    operation_id="listCampaignCommands",
    tag=TAG,
    summary="The campaign's commands, newest first (keyset pagination by id)",
    role=Role.VIEWER,
    errors=[CAMPAIGN_NOT_FOUND],
)
async def list_campaign_commands(
    commands: Commands,
    id: CampaignId,
    status: CommandStatusFilter = None,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> CampaignCommandPage:
    found = await _service(commands).commands(id, status=status, before_id=before, limit=limit + 1)
    items, next_before = page(found, limit, lambda r: from_row(Command, r))
    return CampaignCommandPage(items=items, next_before=next_before)


@route(
    "POST",
    "/campaigns/{id:str}/cancel",
    operation_id="cancelCampaign",
    tag=TAG,
    summary="Cancel the campaign: RUNNING → CANCELLED, its open commands CANCELLED",
    role=Role.OPERATOR,
    writes=True,
    errors=[CAMPAIGN_NOT_FOUND, CAMPAIGN_CLOSED, CAMPAIGN_CHANGED],
    description=(
        "The campaign is read, then closed by a conditional write: of concurrent cancels "
        "exactly one wins. A campaign closed when read is 400 `ILLEGAL_TRANSITION`; one closed "
        "between the read and the write (another operator, or the settler completing or "
        "aborting it) is 409 `STATUS_CHANGED` with its `current_status` and the `actor` who "
        "closed it. Receipts arriving later for its commands are kept and refused "
        "(`COMMAND_CLOSED`). No request body."
    ),
)
async def cancel_campaign(commands: Commands, call: CallDep, id: CampaignId) -> Campaign:
    try:
        row = await _service(commands).cancel(id, actor=actor_of(call), request_id=call.request_id)
    except (CampaignNotFoundError, CampaignClosedError, CampaignChangedError) as exc:
        log.info("campaign_cancel_refused", campaign_id=id, code=exc.code)
        raise
    log.info(
        "campaign_cancelled",
        campaign_id=id,
        token=call.caller.name,
        request_id=call.request_id,
    )
    return campaign_of(row)


# Request bodies that refuse unknown fields (the document says so: app._complete). The
# targets are declared whole by `complete`.
BODIES: Final = (CampaignBody, RolloutBody, AbortBody)


def complete(schemas: dict[str, Any]) -> None:
    """`TargetsBody` as what it is: one of two objects, each with its one required property
    and nothing else, the items with the bounds and patterns the Struct checks (Litestar's
    generation drops those inside a union). Spelled as two properties and a property count
    (`minProperties`/`maxProperties`), the schema gives generators no single-property object
    to start from: schemathesis then finds no valid campaign body at all."""
    device = Schema(
        type=OpenAPIType.STRING,
        min_length=1,
        max_length=ANY_DEVICE_ID_MAX_LENGTH,
        pattern=ANY_DEVICE_ID_PATTERN,
        description="A native device id, or a Sparkplug one (`{group}/{node}[/{device}]`).",
    )
    pattern = Schema(
        type=OpenAPIType.STRING,
        min_length=1,
        max_length=ANY_DEVICE_SELECTOR_MAX_LENGTH,
        pattern=ANY_DEVICE_SELECTOR_PATTERN,
        description="A device id (native or Sparkplug) or an fnmatch glob (`*`, `?`, `[...]`), "
        "as in the rules.",
    )
    devices = Schema(
        type=OpenAPIType.OBJECT,
        title="TargetDevices",
        properties={
            "devices": Schema(
                type=OpenAPIType.ARRAY,
                items=device,
                max_items=TARGETS_MAX,
                description="Device ids; one registered as unbound refuses the campaign (409).",
            )
        },
        required=["devices"],
        additional_properties=False,
    )
    selector = Schema(
        type=OpenAPIType.OBJECT,
        title="TargetSelector",
        properties={
            "selector": Schema(
                one_of=[
                    pattern,
                    Schema(
                        type=OpenAPIType.ARRAY,
                        items=pattern,
                        min_items=1,
                        max_items=SELECTOR_MAX,
                    ),
                ],
                description="The rules' device selector, resolved against the known bound "
                "devices when the campaign starts.",
            )
        },
        required=["selector"],
        additional_properties=False,
    )
    schemas[TargetsBody.__name__] = Schema(
        title=TargetsBody.__name__,
        description="Exactly one of `devices` and `selector`.",
        one_of=[devices, selector],
    )
    # The counts read as whole numbers (`PerMinute`, `MinFinished`) are integers to a reader.
    for body, name, most in (
        (RolloutBody, "per_minute", PER_MINUTE_MAX),
        (AbortBody, "min_finished", MIN_FINISHED_MAX),
    ):
        properties = schemas[body.__name__].properties
        if properties is not None:
            properties[name] = Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=most)


HANDLERS: Final = [
    count_campaign_targets,
    create_campaign,
    list_campaigns,
    get_campaign,
    list_campaign_commands,
    cancel_campaign,
]
