"""The alarm routes (behaviour §5, §9): reads for viewers, people's actions for operators."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final

import structlog
from litestar import Request
from litestar.handlers import HTTPRouteHandler
from litestar.params import JSONBody, Parameter
from msgspec import UnsetType

from gateway.alarms import service as desk
from gateway.alarms.service import AlarmService, OutcomeUnknownError
from gateway.api.auth import CallDep, Role, actor_of
from gateway.api.errors import (
    ALARM_NOT_FOUND,
    ALARM_SUPERSEDED,
    ALREADY_SHELVED,
    DEVICE_NOT_FOUND,
    ILLEGAL_TRANSITION,
    INVALID_ACTOR,
    NOT_OUT_OF_SERVICE,
    SHELF_ENDED,
    SHELF_NOT_FOUND,
    SHELF_TOO_LONG,
    STATUS_CHANGED,
    TOO_MANY_ALARMS,
    UNTIL_PAST,
    bad_request,
    from_domain,
    to_api_error,
    unavailable_reason,
)
from gateway.api.params import (
    AlarmId,
    AnyDeviceId,
    AnyDeviceIdFilter,
    Before,
    DeviceId,
    Id,
    Limit,
    any_device_id,
    page,
)
from gateway.api.routes import route
from gateway.api.schemas import (
    BULK_NOT_ATTEMPTED,
    LIMIT_DEFAULT,
    RULE_KEY_FILTER_PATTERN,
    ActionBody,
    AiSummary,
    AlarmCounts,
    AlarmDetail,
    AlarmFilters,
    AlarmGroup,
    AlarmGroups,
    AlarmPage,
    AlarmView,
    AllowedActions,
    AuditEntry,
    AuditTrail,
    BulkBody,
    BulkItem,
    BulkResults,
    Chain,
    GroupBy,
    OutOfService,
    OutOfServiceBody,
    Shelf,
    ShelfPage,
    ShelveAlarmBody,
    ShelvedFilter,
    ShelvePairBody,
    StateCounts,
    SummaryAttempts,
    exact,
    from_row,
    summary_attempt,
)
from gateway.api.services import Alarms
from gateway.domain.alarm import PERSON_ACTIONS, Action, Alarm, AlarmStatus, Severity

log = structlog.get_logger(__name__)


TAG: Final = "alarms"
# People's actions in a fixed order (the order of the routes and of the document).
PATH_ACTIONS: Final = tuple(a for a in Action if a in PERSON_ACTIONS)

_ID_PATH: Final = "{id:str}"  # parsed by the boundary and the handler's type, not the router


def _desk_fields(view: desk.DeskAlarm) -> dict[str, Any]:
    alarm = view.alarm
    return {
        **{f: getattr(alarm, f) for f in Alarm.__struct_fields__},
        "active": alarm.cleared_at is None,
        "acknowledged": any(
            at is not None for at in (alarm.confirmed_at, alarm.handled_at, alarm.false_at)
        ),
        "shelved_until": view.shelved_until,
        "out_of_service": view.out_of_service,
    }


def alarm_view(view: desk.DeskAlarm) -> AlarmView:
    return AlarmView(**_desk_fields(view))


async def detail(service: AlarmService, alarm_id: int) -> AlarmDetail:
    """An alarm as ``GET /alarms/{id}`` and the actions answer it, with its latest AI summary
    attempt under ``ai_summary`` (null when there is none)."""
    view = await service.view(alarm_id)
    latest = await service.latest_summary(alarm_id)
    summary = None if latest is None else from_row(AiSummary, latest)
    return AlarmDetail(**_desk_fields(view), ai_summary=summary)


_SHELVED_MODE: Final[dict[str, desk.ShelvedMode]] = {
    "false": "exclude",
    "true": "only",
    "any": "any",
}


def filters_of(given: AlarmFilters) -> desk.Filters:
    return desk.Filters(
        statuses=None if given.status is None else [s.value for s in given.status],
        device_id=given.device,
        rule_key=given.rule,
        open_only=given.open,
        active=given.active,
        cleared=given.cleared,
        acknowledged=given.acknowledged,
        shelved=_SHELVED_MODE[given.shelved],
        severity=None if given.severity is None else given.severity.value,
    )


StatusFilter = Annotated[
    list[AlarmStatus] | None,
    Parameter(
        description="Only these statuses (repeat the parameter for several).",
        schema_extra=exact("array", items={"$ref": "#/components/schemas/AlarmStatus"}),
    ),
]
# Any device's id, a native or a Sparkplug one (`{group}/{node}[/{device}]`, whose alarms carry
# it as it reads): a group by device is listed with `device=` its key (docs/api.md).
DeviceFilter = AnyDeviceIdFilter
RuleFilter = Annotated[
    str | None,
    Parameter(
        pattern=RULE_KEY_FILTER_PATTERN,
        schema_extra=exact("string"),
        description="Only this rule key.",
    ),
]
OpenFilter = Annotated[
    bool,
    Parameter(description="Only open alarms (NEW, PUSHED, DELAYED, CONFIRMED, ESCALATED)."),
]
ActiveFilter = Annotated[
    bool | None,
    Parameter(
        schema_extra=exact("boolean"),
        description="true: only alarms whose condition is still true (not cleared); false: "
        "only those returned to normal.",
    ),
]
ClearedFilter = Annotated[
    bool | None,
    Parameter(
        schema_extra=exact("boolean"),
        description="true: only alarms returned to normal (cleared); false: only active ones.",
    ),
]
AckFilter = Annotated[
    bool | None,
    Parameter(
        schema_extra=exact("boolean"),
        description="true: only alarms a person acknowledged (confirmed, handled or judged "
        "false); false: only those nobody did.",
    ),
]
ShelvedParam = Annotated[
    ShelvedFilter,
    Parameter(
        description="false (the default view): shelved alarms left out; true: only shelved "
        "ones; any: both."
    ),
]
SeverityFilter = Annotated[Severity | None, Parameter(description="Only this severity.")]


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
    status: StatusFilter = None,
    device: DeviceFilter = None,
    rule: RuleFilter = None,
    open: OpenFilter = False,
    active: ActiveFilter = None,
    cleared: ClearedFilter = None,
    acknowledged: AckFilter = None,
    shelved: ShelvedParam = "false",
    severity: SeverityFilter = None,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> AlarmPage:
    filters = AlarmFilters(
        status=status, device=device, rule=rule, open=open, active=active, cleared=cleared,
        acknowledged=acknowledged, shelved=shelved, severity=severity,
    )  # fmt: skip
    # One more than asked: a next page is promised only if it has something on it.
    found = await alarms.views(filters_of(filters), before_id=before, limit=limit + 1)
    items = [alarm_view(v) for v in found[:limit]]
    return AlarmPage(items=items, next_before=items[-1].id if len(found) > limit else None)


@route(
    "GET",
    "/alarms/counts",
    summary="Open alarms per severity and state (the desk's header)",
    operation_id="countAlarms",
    tag=TAG,
    role=Role.VIEWER,
    description=(
        "Open alarms (NEW, PUSHED, DELAYED, CONFIRMED, ESCALATED) in exclusive buckets: "
        "`shelved`, then the rest by active or returned to normal, acknowledged or not; "
        "`out_of_service` overlaps them. One pass over the open alarms."
    ),
)
async def count_alarms(alarms: Alarms) -> AlarmCounts:
    by_severity = {s: StateCounts() for s in Severity}
    every = StateCounts()
    for row in await alarms.counts():
        counts = StateCounts(**{f: int(row[f]) for f in StateCounts.__struct_fields__})
        by_severity[Severity(row["severity"])] = counts
        for f in StateCounts.__struct_fields__:
            setattr(every, f, getattr(every, f) + getattr(counts, f))
    return AlarmCounts(all=every, by_severity=by_severity)


_WORST: Final = {1: Severity.INFO, 2: Severity.WARNING, 3: Severity.MAJOR, 4: Severity.CRITICAL}
# A page of groups ends at its last group's worst severity (1-4) and newest id: `4:412`.
GROUP_CURSOR_PATTERN: Final = r"^[1-4]:[1-9][0-9]{0,18}$"
_ID_MAX: Final = 2**63 - 1
GroupBefore = Annotated[
    str | None,
    Parameter(
        pattern=GROUP_CURSOR_PATTERN,
        schema_extra=exact("string"),
        description="Keyset cursor: only the groups after it (`next_before`).",
    ),
]


_XID_MAX: Final = 2**63 - 1
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def split_as_of(text: str) -> desk.ReadAsOf:
    """A group's ``as_of`` (matching ``SNAPSHOT_PATTERN``: `xmin:xmax:running,...@micros`).
    Any such text is taken (ids past the database's bigint cut to its largest): one no group
    answered selects what its numbers say, never an error."""
    snapshot, _, micros = text.partition("@")
    xmin, xmax, running = snapshot.split(":")
    return desk.ReadAsOf(
        xmin=min(int(xmin), _XID_MAX),
        xmax=min(int(xmax), _XID_MAX),
        running=[min(int(x), _XID_MAX) for x in running.split(",") if x],
        at=_EPOCH + timedelta(microseconds=int(micros)),
    )


def _group_cursor(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    worst, _, newest = text.partition(":")
    if int(newest) > _ID_MAX:
        raise bad_request("before", "not a cursor this API gave (`next_before`)")
    return int(worst), int(newest)


@route(
    "GET",
    "/alarms/groups",
    summary="Alarms grouped by rule or by device, over the list's filters",
    operation_id="groupAlarms",
    tag=TAG,
    role=Role.VIEWER,
    description=(
        "One row per rule key (or device): how many alarms, the newest one's trigger time "
        "and id, the worst severity; worst first, then newest, paged (`next_before`). A "
        "group's alarms are `GET /alarms` with the same filters and `rule` (or `device`) set "
        "to its key."
    ),
)
async def group_alarms(
    alarms: Alarms,
    *,
    by: Annotated[GroupBy, Parameter(description="rule (the default) or device.")] = "rule",
    status: StatusFilter = None,
    device: DeviceFilter = None,
    rule: RuleFilter = None,
    open: OpenFilter = False,
    active: ActiveFilter = None,
    cleared: ClearedFilter = None,
    acknowledged: AckFilter = None,
    shelved: ShelvedParam = "false",
    severity: SeverityFilter = None,
    limit: Limit = LIMIT_DEFAULT,
    before: GroupBefore = None,
) -> AlarmGroups:
    filters = AlarmFilters(
        status=status, device=device, rule=rule, open=open, active=active, cleared=cleared,
        acknowledged=acknowledged, shelved=shelved, severity=severity,
    )  # fmt: skip
    # One more than asked: a next page is promised only if it has something on it.
    found = await alarms.groups(
        filters_of(filters), by=by, limit=limit + 1, before=_group_cursor(before)
    )
    rows = found[:limit]
    more = len(found) > limit
    return AlarmGroups(
        by=by,
        next_before=f"{rows[-1]['worst']}:{rows[-1]['newest_id']}" if more else None,
        items=[
            AlarmGroup(
                key=r["key"],
                count=r["count"],
                newest_at=r["newest_at"],
                newest_id=r["newest_id"],
                worst_severity=_WORST[r["worst"]],
                as_of=r["as_of"],
            )
            for r in rows
        ],
    )


@route(
    "POST",
    "/alarms/bulk",
    summary="One person's action on many alarms, with a result per alarm",
    operation_id="bulkAlarms",
    tag=TAG,
    role=Role.OPERATOR,
    body=True,  # no `writes`: an alarm whose audit row is refused is an item (`AUDIT_FAILED`)
    errors=[TOO_MANY_ALARMS, INVALID_ACTOR],
    description=(
        "`confirm`, `false` or `close` on the alarms `ids`, or on every alarm of a `group` "
        "(as `GET /alarms/groups` showed it, with its filters; with `up_to`, its `newest_id` "
        "as read, the alarms raised since are left alone; with `as_of` as read, those "
        "committed since too, a lower id included). Each alarm is acted on as "
        "`POST /alarms/{id}/{action}` would: its own conditional write, audit row and event, "
        "in its own transaction. One refused, or rolled back (`AUDIT_FAILED`), leaves the "
        "others be; once the database is out of reach or rolls an alarm's change back (a "
        "deadlock: `UNAVAILABLE`), or an alarm's audit row waited past its bound for the "
        "`alarm_audit` table (held: an index being built), the alarms after it are not attempted "
        f"(`{BULK_NOT_ATTEMPTED}`, the message says why). 200 with `items`, what happened to "
        "each: an alarm acted on before a fault stays acted on. More alarms than "
        "`[alarms] bulk_max` is refused whole (400 `TOO_MANY_ALARMS`), nothing done."
    ),
)
async def bulk_alarms(
    alarms: Alarms, call: CallDep, request: Request[Any, Any, Any], data: JSONBody[BulkBody]
) -> BulkResults:
    if isinstance(data.ids, UnsetType):
        assert not isinstance(data.group, UnsetType)  # the body names exactly one
        up_to = None if isinstance(data.group.up_to, UnsetType) else int(data.group.up_to)
        as_of = None if isinstance(data.group.as_of, UnsetType) else split_as_of(data.group.as_of)
        ids = await alarms.group_ids(
            filters_of(data.group.filters),
            by=data.group.by,
            key=data.group.key,
            up_to=up_to,
            as_of=as_of,
        )
    else:
        ids = [int(i) for i in data.ids]
    stated = None if isinstance(data.actor, UnsetType) else data.actor
    results = await alarms.bulk(
        Action(data.action),
        ids,
        actor=actor_of(call),
        stated_actor=stated,
        note=data.note,
        request_id=call.request_id,
    )
    items: list[BulkItem] = []
    stopped = ""  # why the action stopped: what the alarm it stopped at met
    for result in results:
        if result.alarm is not None:
            items.append(BulkItem(alarm_id=result.alarm_id, ok=True, status=result.alarm.status))
            continue
        if result.error is None:
            items.append(
                BulkItem(
                    alarm_id=result.alarm_id,
                    ok=False,
                    error=BULK_NOT_ATTEMPTED,
                    message=f"not attempted: {stopped}; nothing of this one changed, retry",
                )
            )
            continue
        stopped = (
            f"the database went out of reach as alarm {result.alarm_id}'s change was committed"
            if isinstance(result.error, OutcomeUnknownError)
            else f"the action stopped at alarm {result.alarm_id}, "
            f"{unavailable_reason(result.error)}"
        )
        # What the single action would answer (and log): a refusal, AUDIT_FAILED, UNAVAILABLE.
        refused = to_api_error(request, result.error)
        current = refused.details.get("current_status")
        items.append(
            BulkItem(
                alarm_id=result.alarm_id,
                ok=False,
                error=refused.kind.code,
                message=refused.message,
                current_status=current if isinstance(current, str) else None,
                outcome_unknown=refused.details.get("outcome_unknown") is True,
            )
        )
    done = sum(1 for item in items if item.ok)
    log.info(
        "alarm_bulk_action",
        action=data.action,
        actor=call.caller.name,
        request_id=call.request_id,
        done=done,
        refused=len(items) - done,
    )
    return BulkResults(action=data.action, done=done, refused=len(items) - done, items=items)


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
    return await detail(alarms, id)


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
    items = [alarm_view(view) for view in await alarms.chain(id)]
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
        return await detail(alarms, alarm.id)

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


# --- shelves ------------------------------------------------------------------------------------


def _shelf(row: Any) -> Shelf:
    return from_row(Shelf, row)


_SHELVING: Final = (
    "A shelved alarm still exists and is counted; it leaves the default list "
    "(`GET /alarms?shelved=true` shows it) and its notifications are suppressed. It ends by "
    "itself after `duration_s` (at most `[alarms] shelve_max_s`), or when lifted "
    "(`DELETE /shelves/{id}`). Audited on every alarm it covers."
)


def _shelved(call: Any, row: Any) -> Shelf:
    log.info(
        "alarm_shelved",
        shelf_id=row["id"],
        scope=row["scope"],
        alarm_id=row["alarm_id"],
        device_id=row["device_id"],
        rule_key=row["rule_key"],
        actor=call.caller.name,
        request_id=call.request_id,
    )
    return _shelf(row)


@route(
    "POST",
    f"/alarms/{_ID_PATH}/shelve",
    summary="Shelve the alarm, or its rule on its device, for a while (ISA-18.2)",
    operation_id="shelveAlarm",
    tag=TAG,
    role=Role.OPERATOR,
    writes=True,
    body=True,
    status_code=201,
    errors=[ALARM_NOT_FOUND, ALREADY_SHELVED, SHELF_TOO_LONG],
    description=(
        "Scope `alarm`: this alarm; `pair`: every alarm of its rule on its device, now and "
        "raised while the shelf lasts. " + _SHELVING
    ),
)
async def shelve_alarm(
    alarms: Alarms, call: CallDep, id: AlarmId, data: JSONBody[ShelveAlarmBody]
) -> Shelf:
    row = await alarms.shelve(
        scope=data.scope,
        alarm_id=id,
        device_id=None,
        rule_key=None,
        seconds=data.duration_s,
        reason=data.reason,
        actor=actor_of(call),
        request_id=call.request_id,
    )
    return _shelved(call, row)


@route(
    "POST",
    "/shelves",
    summary="Shelve a rule on a device for a while (ISA-18.2)",
    operation_id="shelveRule",
    tag=TAG,
    role=Role.OPERATOR,
    writes=True,
    body=True,
    status_code=201,
    errors=[ALREADY_SHELVED, SHELF_TOO_LONG],
    description=(
        "Every alarm of `rule_key` on `device_id`, now and raised while the shelf lasts. "
        + _SHELVING
    ),
)
async def shelve_rule(alarms: Alarms, call: CallDep, data: JSONBody[ShelvePairBody]) -> Shelf:
    row = await alarms.shelve(
        scope="pair",
        alarm_id=None,
        device_id=data.device_id,
        rule_key=data.rule_key,
        seconds=data.duration_s,
        reason=data.reason,
        actor=actor_of(call),
        request_id=call.request_id,
    )
    return _shelved(call, row)


@route(
    "GET",
    "/shelves",
    summary="Shelves, newest first (keyset pagination by id)",
    operation_id="listShelves",
    tag=TAG,
    role=Role.VIEWER,
)
async def list_shelves(
    alarms: Alarms,
    *,
    in_force: Annotated[
        bool, Parameter(description="Only shelves in force now (false: every shelf).")
    ] = True,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> ShelfPage:
    found = await alarms.shelves(in_force=in_force, before_id=before, limit=limit + 1)
    items, next_before = page(found, limit, _shelf)
    return ShelfPage(items=items, next_before=next_before)


@route(
    "GET",
    "/shelves/{id:str}",
    summary="One shelf",
    operation_id="getShelf",
    tag=TAG,
    role=Role.VIEWER,
    errors=[SHELF_NOT_FOUND],
)
async def get_shelf(alarms: Alarms, id: Id) -> Shelf:
    return _shelf(await alarms.shelf(id))


@route(
    "DELETE",
    "/shelves/{id:str}",
    summary="Lift a shelf before its time",
    operation_id="liftShelf",
    tag=TAG,
    role=Role.OPERATOR,
    writes=True,
    errors=[SHELF_NOT_FOUND, SHELF_ENDED],
    description="Audited on every alarm it covers; a shelf that ended already is a 409.",
)
async def lift_shelf(alarms: Alarms, call: CallDep, id: Id) -> Shelf:
    row = await alarms.lift(id, actor=actor_of(call), request_id=call.request_id)
    log.info("alarm_shelf_lifted", shelf_id=id, actor=call.caller.name, request_id=call.request_id)
    return _shelf(row)


# --- out of service ----------------------------------------------------------------------------


_OUT_OF_SERVICE: Final = (
    "Its alarms are still raised and shown (`out_of_service` on each), their "
    "notifications suppressed. Until `until`, or until ended (`DELETE`); a period in "
    "force is replaced."
)
_BY_QUERY: Final = (
    " for any device, Sparkplug ones included (`?id=Plant1%2FLine4%2FOven`), whose `/` no "
    "path can carry (an encoded `%2F` is decoded before routing)."
)


@route(
    "PUT",
    "/devices/{id:str}/out-of-service",
    summary="Put a device out of service (maintenance)",
    operation_id="setOutOfService",
    tag=TAG,
    role=Role.OPERATOR,
    writes=True,
    body=True,
    errors=[DEVICE_NOT_FOUND, UNTIL_PAST],
    description=_OUT_OF_SERVICE
    + " A Sparkplug device, whose id holds `/`: `PUT /device/out-of-service?id=`.",
)
async def set_out_of_service(
    alarms: Alarms, call: CallDep, id: DeviceId, data: JSONBody[OutOfServiceBody]
) -> OutOfService:
    return await _set_out_of_service(alarms, call, id, data)


@route(
    "PUT",
    "/device/out-of-service",
    summary="Put a device named in the query out of service: a native or a Sparkplug id",
    operation_id="setOutOfServiceById",
    tag=TAG,
    role=Role.OPERATOR,
    writes=True,
    body=True,
    errors=[DEVICE_NOT_FOUND, UNTIL_PAST],
    description="`PUT /devices/{id}/out-of-service`" + _BY_QUERY + " " + _OUT_OF_SERVICE,
)
async def set_out_of_service_by_id(
    alarms: Alarms, call: CallDep, id: AnyDeviceId, data: JSONBody[OutOfServiceBody]
) -> OutOfService:
    return await _set_out_of_service(alarms, call, any_device_id(id), data)


async def _set_out_of_service(
    alarms: Alarms, call: CallDep, id: str, data: OutOfServiceBody
) -> OutOfService:
    row = await alarms.set_out_of_service(
        id, reason=data.reason, until=data.until, actor=actor_of(call), request_id=call.request_id
    )
    log.info("device_out_of_service", device_id=id, actor=call.caller.name, until=data.until)
    return from_row(OutOfService, row)


@route(
    "DELETE",
    "/devices/{id:str}/out-of-service",
    summary="Put a device back in service",
    operation_id="endOutOfService",
    tag=TAG,
    role=Role.OPERATOR,
    writes=True,
    errors=[DEVICE_NOT_FOUND, NOT_OUT_OF_SERVICE],
    description="A Sparkplug device, whose id holds `/`: `DELETE /device/out-of-service?id=`.",
)
async def end_out_of_service(alarms: Alarms, call: CallDep, id: DeviceId) -> OutOfService:
    return await _end_out_of_service(alarms, call, id)


@route(
    "DELETE",
    "/device/out-of-service",
    summary="Put a device named in the query back in service: a native or a Sparkplug id",
    operation_id="endOutOfServiceById",
    tag=TAG,
    role=Role.OPERATOR,
    writes=True,
    errors=[DEVICE_NOT_FOUND, NOT_OUT_OF_SERVICE],
    description="`DELETE /devices/{id}/out-of-service`" + _BY_QUERY,
)
async def end_out_of_service_by_id(alarms: Alarms, call: CallDep, id: AnyDeviceId) -> OutOfService:
    return await _end_out_of_service(alarms, call, any_device_id(id))


async def _end_out_of_service(alarms: Alarms, call: CallDep, id: str) -> OutOfService:
    row = await alarms.end_out_of_service(id, actor=actor_of(call))
    log.info("device_back_in_service", device_id=id, actor=call.caller.name)
    return from_row(OutOfService, row)


HANDLERS: Final = [
    list_alarms,
    count_alarms,
    group_alarms,
    bulk_alarms,
    shelve_alarm,
    shelve_rule,
    list_shelves,
    get_shelf,
    lift_shelf,
    set_out_of_service,
    set_out_of_service_by_id,
    end_out_of_service,
    end_out_of_service_by_id,
    get_alarm,
    alarm_actions,
    alarm_chain,
    alarm_audit,
    alarm_summaries,
    *(_action_route(action) for action in PATH_ACTIONS),
]
