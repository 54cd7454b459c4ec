"""The alarm system's own figures over HTTP: ``GET /alarm-stats?window=`` (EEMUA 191,
ISA-18.2; docs/alarm-figures.md)."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from litestar.params import Parameter

from gateway.alarms.figures import WINDOW_DEFAULT, WINDOW_PATTERN, WindowError, parse_window
from gateway.api.auth import Role
from gateway.api.errors import bad_request
from gateway.api.routes import route
from gateway.api.schemas import AlarmStats, exact
from gateway.api.services import Alarms

TAG: Final = "alarms"

Window = Annotated[
    str,
    Parameter(
        pattern=WINDOW_PATTERN,
        schema_extra=exact("string"),
        description=(
            "How far back from now: a whole number of minutes, hours or days (`10m`, `24h`, "
            "`7d`), from 10m to 31d; anything else is a 400."
        ),
    ),
]


@route(
    "GET",
    "/alarm-stats",
    summary="The alarm system's own figures over a window (EEMUA 191, ISA-18.2)",
    operation_id="getAlarmStats",
    tag=TAG,
    role=Role.VIEWER,
    description=(
        "Alarms per fixed 10-minute interval (series, average, peak), flood periods, chattering "
        "(rule, device) pairs, stale alarms, the top 10 rules and devices, people's actions per "
        "operator and the time to acknowledge, with the thresholds of `[alarms.figures]`. "
        "Computed in PostgreSQL on each call, in one read-only transaction."
    ),
)
async def alarm_stats(alarms: Alarms, window: Window = WINDOW_DEFAULT) -> AlarmStats:
    try:
        span = parse_window(window)
    except WindowError as exc:
        raise bad_request("window", str(exc)) from None
    report = await alarms.stats(span)
    return msgspec.convert({**report, "window": window}, AlarmStats)


HANDLERS: Final = [alarm_stats]
