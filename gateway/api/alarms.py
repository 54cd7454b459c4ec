"""The alarm routes (behaviour §5, §9): reads for viewers, people's actions for operators."""

from __future__ import annotations

from typing import Annotated, Final

import structlog
from litestar.handlers import HTTPRouteHandler
from litestar.params import JSONBody, Parameter
from msgspec import UnsetType

from gateway.alarms.service import AlarmService
from gateway.api.auth import CallDep, Role, actor_of
from gateway.api.errors import (
    ALARM_NOT_FOUND,
    ALARM_SUPERSEDED,
    ILLEGAL_TRANSITION,
    STATUS_CHANGED,
    from_domain,
)
from gateway.api.params import AlarmId, Before, Limit, page
from gateway.api.routes import route
from gateway.api.schemas import (
    DEVICE_ID_PATTERN,
    LIMIT_DEFAULT,
    RULE_KEY_FILTER_PATTERN,
    ActionBody,
    AiSummary,
    AlarmDetail,
    AlarmPage,
    AllowedActions,
    AuditEntry,
    AuditTrail,
    Chain,
    SummaryAttempts,
    exact,
    from_row,
    summary_attempt,
)
from gateway.api.services import Alarms
from gateway.domain.alarm import PERSON_ACTIONS, Action, Alarm, AlarmStatus

log = structlog.get_logger(__name__)


TAG: Final = "alarms"
# People's actions in a fixed order (the order of the routes and of the document).
PATH_ACTIONS: Final = tuple(a for a in Action if a in PERSON_ACTIONS)

_ID_PATH: Final = "{id:str}"  # parsed by the boundary and the handler's type, not the router


async def detail(service: AlarmService, alarm: Alarm) -> AlarmDetail:
    """An alarm as ``GET /alarms/{id}`` and the actions answer it, with its latest AI summary
    attempt under ``ai_summary`` (null when there is none)."""
    latest = await service.latest_summary(alarm.id)
    summary = None if latest is None else from_row(AiSummary, latest)
    return AlarmDetail(
        **{f: getattr(alarm, f) for f in Alarm.__struct_fields__}, ai_summary=summary
    )


@route(
    "GET",
    "/alarms",
    summary="List alarms, newest first (keyset pagination by id)",
    operation_id="listAlarms",
    tag=TAG,
    role=Role.VIEWER,
)
async def list_alarms(
    alarms: Alarms,
    *,
    status: Annotated[
        list[AlarmStatus] | None,
        Parameter(
            description="Only these statuses (repeat the parameter for several).",
            schema_extra=exact("array", items={"$ref": "#/components/schemas/AlarmStatus"}),
        ),
    ] = None,
    device: Annotated[
        str | None,
        Parameter(
            pattern=DEVICE_ID_PATTERN, schema_extra=exact("string"), description="Only this device."
        ),
    ] = None,
    rule: Annotated[
        str | None,
        Parameter(
            pattern=RULE_KEY_FILTER_PATTERN,
            schema_extra=exact("string"),
            description="Only this rule key.",
        ),
    ] = None,
    open: Annotated[
        bool,
        Parameter(description="Only open alarms (NEW, PUSHED, DELAYED, CONFIRMED, ESCALATED)."),
    ] = False,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> AlarmPage:
    # One more than asked: a next page is promised only if it has something on it.
    found = await alarms.find(
        statuses=None if status is None else [s.value for s in status],
        device_id=device,
        rule_key=rule,
        open_only=open,
        before_id=before,
        limit=limit + 1,
    )
    items, next_before = page(found, limit)
    return AlarmPage(items=items, next_before=next_before)


@route(
    "GET",
    f"/alarms/{_ID_PATH}",
    summary="One alarm",
    operation_id="getAlarm",
    tag=TAG,
    role=Role.VIEWER,
    errors=[ALARM_NOT_FOUND],
)
async def get_alarm(alarms: Alarms, id: AlarmId) -> AlarmDetail:
    return await detail(alarms, await alarms.get(id))


@route(
    "GET",
    f"/alarms/{_ID_PATH}/actions",
    operation_id="getAlarmActions",
    tag=TAG,
    summary="The people's actions allowed now (render buttons from this, never guess)",
    role=Role.VIEWER,
    errors=[ALARM_NOT_FOUND],
)
async def alarm_actions(alarms: Alarms, id: AlarmId) -> AllowedActions:
    alarm, allowed = await alarms.allowed(id)
    if alarm.status is AlarmStatus.SUPERSEDED:
        return AllowedActions(status=alarm.status, actions=[], superseded_by=alarm.superseded_by)
    return AllowedActions(status=alarm.status, actions=list(allowed))


@route(
    "GET",
    f"/alarms/{_ID_PATH}/chain",
    operation_id="getAlarmChain",
    tag=TAG,
    summary="The supersede chain that ends at this alarm",
    role=Role.VIEWER,
    errors=[ALARM_NOT_FOUND],
)
async def alarm_chain(alarms: Alarms, id: AlarmId) -> Chain:
    items = await alarms.chain(id)
    this = next(a for a in items if a.id == id)
    if this.status is AlarmStatus.SUPERSEDED:
        successor = "a newer alarm" if this.superseded_by is None else this.superseded_by
        return Chain(
            items=items,
            hint=f"superseded by {successor}, cannot be handled on its own",
            superseded_by=this.superseded_by,
        )
    return Chain(items=items)


@route(
    "GET",
    f"/alarms/{_ID_PATH}/audit",
    operation_id="getAlarmAudit",
    tag=TAG,
    summary="The audit trail of the alarm, oldest first",
    role=Role.VIEWER,
    errors=[ALARM_NOT_FOUND],
)
async def alarm_audit(alarms: Alarms, id: AlarmId) -> AuditTrail:
    return AuditTrail(items=[from_row(AuditEntry, r) for r in await alarms.audit(id)])


@route(
    "GET",
    f"/alarms/{_ID_PATH}/summaries",
    operation_id="getAlarmSummaries",
    tag=TAG,
    summary="Every AI summary attempt of the alarm, oldest first",
    description="`request_payload` and `raw_response` are included for admin tokens only.",
    role=Role.VIEWER,
    errors=[ALARM_NOT_FOUND],
)
async def alarm_summaries(
    alarms: Alarms,
    call: CallDep,
    id: AlarmId,
) -> SummaryAttempts:
    rows = await alarms.summaries(id)
    admin = call.caller.role >= Role.ADMIN
    return SummaryAttempts(items=[summary_attempt(r, with_payloads=admin) for r in rows])


def _action_route(action: Action) -> HTTPRouteHandler:
    async def act(
        alarms: Alarms,
        call: CallDep,
        id: AlarmId,
        data: JSONBody[ActionBody],
    ) -> AlarmDetail:
        stated = None if isinstance(data.actor, UnsetType) else data.actor
        try:
            alarm = await alarms.act(
                id,
                action,
                actor=actor_of(call),
                stated_actor=stated,
                note=data.note,
                request_id=call.request_id,
            )
        except Exception as exc:
            refused = from_domain(exc)
            if refused is None:
                raise
            log.info(
                "alarm_action_refused",
                alarm_id=id,
                action=action.value,
                actor=call.caller.name,
                stated_actor=stated,
                request_id=call.request_id,
                code=refused.kind.code,
            )
            raise refused from exc
        log.info(
            "alarm_action",
            alarm_id=id,
            action=action.value,
            actor=call.caller.name,
            stated_actor=stated,
            request_id=call.request_id,
            status=alarm.status.value,
        )
        return await detail(alarms, alarm)

    act.__name__ = f"{action.value}_alarm"
    return route(
        "POST",
        f"/alarms/{_ID_PATH}/{action.value}",
        summary=f"{action.value.capitalize()} the alarm (a person's action)",
        operation_id=f"{action.value}Alarm",
        tag=TAG,
        role=Role.OPERATOR,
        writes=True,
        body=True,
        errors=[ALARM_NOT_FOUND, ILLEGAL_TRANSITION, ALARM_SUPERSEDED, STATUS_CHANGED],
        description=(
            "Conditional on the status the gateway read: of concurrent requests exactly one "
            "wins, the others get 409. The change, its audit row and its event commit together "
            "or not at all."
        ),
    )(act)


HANDLERS: Final = [
    list_alarms,
    get_alarm,
    alarm_actions,
    alarm_chain,
    alarm_audit,
    alarm_summaries,
    *(_action_route(action) for action in PATH_ACTIONS),
]
