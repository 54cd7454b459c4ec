"""The rules this node runs, as the console needs them: a chart draws a threshold rule's
trigger and clear lines (``GET /rules?device=&metric=``)."""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec
from litestar import Request
from litestar.params import Parameter

from gateway.api.auth import Role
from gateway.api.errors import bad_request
from gateway.api.routes import route
from gateway.api.schemas import ANY_DEVICE_ID_MAX_LENGTH, ANY_DEVICE_ID_PATTERN, exact
from gateway.api.services import services_of
from gateway.domain.rules import EventRule, InactivityRule, Rule, ThresholdRule
from protocol import MetricValue, is_valid_device_id, sparkplug

TAG: Final = "rules"
METRIC_PATTERN: Final = r"^[^\u0000]{1,128}$"


class RuleView(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A rule as loaded (``[[rules]]``): its key, kind, severity, description and device
    selector; a threshold rule's ``metric``, ``op``, ``value`` (it fires past this) and
    ``clear_value`` (it clears back past this; equal to ``value`` without hysteresis),
    ``for_samples`` and ``for_seconds``; an event rule's ``event``; an inactivity rule's
    ``silent_seconds``."""

    key: str
    kind: str
    severity: str
    description: str
    devices: list[str]
    metric: str | None = None
    op: str | None = None
    value: MetricValue | None = None
    clear_value: MetricValue | None = None
    for_samples: int | None = None
    for_seconds: float | None = None
    event: str | None = None
    silent_seconds: float | None = None


class RuleList(msgspec.Struct, kw_only=True):
    """Every rule matching the filters, in the configuration's order (not paged: the rules
    are the configuration's, a few hundred at most)."""

    items: list[RuleView]


def _view(rule: Rule) -> RuleView:
    view = RuleView(
        key=rule.key,
        kind=rule.kind,
        severity=str(rule.severity.value),
        description=rule.description,
        devices=list(rule.selector.patterns),
    )
    if isinstance(rule, ThresholdRule):
        view.metric = rule.metric
        view.op = rule.op
        view.value = rule.value
        view.clear_value = rule.clear_threshold
        view.for_samples = rule.for_samples
        view.for_seconds = rule.for_seconds
    elif isinstance(rule, EventRule):
        view.event = rule.event
    elif isinstance(rule, InactivityRule):
        view.silent_seconds = rule.silent_seconds
    return view


@route(
    "GET",
    "/rules",
    summary="The rules this node runs (for a chart: a threshold rule's trigger and clear lines)",
    operation_id="listRules",
    tag=TAG,
    role=Role.VIEWER,
    description=(
        "The node's rules as loaded from its configuration (reloaded on `SIGHUP`). `device`: "
        "only the rules whose selector picks this device; `metric`: only threshold rules on "
        "this metric."
    ),
)
async def list_rules(
    request: Request[Any, Any, Any],
    *,
    device: Annotated[
        str | None,
        Parameter(
            pattern=ANY_DEVICE_ID_PATTERN,
            max_length=ANY_DEVICE_ID_MAX_LENGTH,
            schema_extra=exact("string"),
            description=(
                "Only rules that apply to this device: a native id or a Sparkplug one "
                "(`{group}/{node}[/{device}]`)."
            ),
        ),
    ] = None,
    metric: Annotated[
        str | None,
        Parameter(
            pattern=METRIC_PATTERN,
            schema_extra=exact("string"),
            description="Only threshold rules on this metric.",
        ),
    ] = None,
) -> RuleList:
    if device is not None and not (is_valid_device_id(device) or sparkplug.is_device_key(device)):
        # The pattern's `$` admits a closing "\n" in Python: the protocol's checks decide.
        raise bad_request("device", f"must match {ANY_DEVICE_ID_PATTERN}")
    rules = services_of(request).replay().engine.rules
    chosen = rules.for_device(device) if device is not None else tuple(rules)
    if metric is not None:
        chosen = tuple(r for r in chosen if isinstance(r, ThresholdRule) and r.metric == metric)
    return RuleList(items=[_view(r) for r in chosen])


HANDLERS: Final = [list_rules]
