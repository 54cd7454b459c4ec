"""The device routes (behaviour §2, §3): what the gateway knows of each device, for viewers."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final

import msgspec
from litestar.params import Parameter

from gateway.api.auth import Role
from gateway.api.errors import DEVICE_NOT_FOUND, ApiError, bad_request
from gateway.api.params import AnyDeviceId, DeviceId, Limit, any_device_id
from gateway.api.routes import route
from gateway.api.schemas import (
    ANY_DEVICE_ID_MAX_LENGTH,
    ANY_DEVICE_ID_PATTERN,
    ANY_SELECTOR_PATTERN,
    LIMIT_DEFAULT,
    SELECTOR_ITEMS_MAX,
    TIME_PATTERN,
    TIME_RANGE,
    ClockAdjustmentSeen,
    Device,
    DeviceClockFigures,
    DeviceDetail,
    DeviceOne,
    DevicePage,
    LatestEvent,
    LatestMetric,
    OutOfService,
    Presence,
    Sample,
    SamplePage,
    exact,
    from_row,
    time_problem,
)
from gateway.api.services import Alarms, Pool
from gateway.domain.errors import ConfigError
from gateway.domain.rules import DeviceSelector, device_selector
from protocol.ids import IDENTIFIER_PATTERN
from storage import console as repo
from storage import device_clock as clock_repo
from storage.device_clock import ClockFigure

TAG: Final = "devices"
# Latest metrics and events come from the device's newest samples: this many of them.
LATEST_WINDOW: Final = 1000
LATEST_EVENTS_MAX: Final = 20
# A selector scan reads at most this many devices per request; the page then ends early,
# with a cursor to go on from (so one request never reads a whole large fleet).
SELECTOR_SCAN_MAX: Final = 10_000
_SCAN_BATCH: Final = 500
_METRIC_PATTERN: Final = IDENTIFIER_PATTERN.removesuffix(r"\Z") + "$"
SAMPLE_CURSOR_PATTERN: Final = r"^[0-9]{1,19}-[0-9a-f]{64}$"
_SAMPLE_CURSOR: Final = re.compile(SAMPLE_CURSOR_PATTERN.removesuffix("$") + r"\Z")
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_LATEST: Final = datetime(9999, 12, 31, tzinfo=UTC)


def _selector(text: str | None) -> DeviceSelector | None:
    """The rules' device selector: comma-separated device ids and globs (``door-*,pump-1``);
    the pattern admits only what the rules accept, this check stays as the rules' own."""
    if text is None:
        return None
    try:
        return device_selector(text.split(","), "selector")
    except ConfigError as exc:
        raise bad_request("selector", exc.message) from None


def _device(row: Any) -> Device:
    return Device(
        device_id=row["device_id"],
        presence=row["presence"],
        first_seen=row["first_seen"],
        last_seen=row["last_seen"],
        open_alarms=int(row["open_alarms"]),
    )


@route(
    "GET",
    "/devices",
    summary="List devices by id (keyset pagination, ascending)",
    operation_id="listDevices",
    tag=TAG,
    role=Role.VIEWER,
)
async def list_devices(
    pool: Pool,
    *,
    presence: Annotated[
        Presence | None,
        Parameter(description="Only devices with this presence.", schema_extra=exact("string")),
    ] = None,
    selector: Annotated[
        str | None,
        Parameter(
            pattern=ANY_SELECTOR_PATTERN,
            schema_extra=exact("string"),
            description=(
                "Only devices the rules' selector syntax picks: device ids and globs "
                "(`*`, `?`, `[...]`, `[!...]`), comma-separated, e.g. `door-*,pump-1`, "
                "Sparkplug ids and globs across their levels too (`Plant1/*`); at most "
                f"{SELECTOR_ITEMS_MAX} of them, each a device id or a glob of at most 64 "
                "characters."
            ),
        ),
    ] = None,
    limit: Limit = LIMIT_DEFAULT,
    after: Annotated[
        str | None,
        Parameter(
            pattern=ANY_DEVICE_ID_PATTERN,
            max_length=ANY_DEVICE_ID_MAX_LENGTH,
            schema_extra=exact("string"),
            description=(
                "Keyset cursor: only devices whose id sorts after this (`next_after`, a native "
                "or a Sparkplug id)."
            ),
        ),
    ] = None,
) -> DevicePage:
    chosen = _selector(selector)
    if chosen is None:
        rows = await repo.device_page(pool, presence=presence, after=after, limit=limit + 1)
        page = [_device(r) for r in rows[:limit]]
        more = len(rows) > limit
        return _page(page, page[-1].device_id if more else None)
    # Globs do not translate to SQL exactly: the selector itself picks, over a bounded scan.
    found: list[Device] = []
    cursor, scanned = after, 0
    while scanned < SELECTOR_SCAN_MAX:
        rows = await repo.device_page(pool, presence=presence, after=cursor, limit=_SCAN_BATCH)
        for row in rows:
            scanned += 1
            cursor = row["device_id"]
            if chosen.matches(row["device_id"]):
                found.append(_device(row))
                if len(found) == limit:
                    return _page(found, cursor)
        if len(rows) < _SCAN_BATCH:
            return _page(found, None)
    return _page(found, cursor)


def _page(devices: list[Device], next_after: str | None) -> DevicePage:
    # `devices` repeats `items` for clients written before the one envelope (deprecated).
    return DevicePage(items=devices, devices=devices, next_after=next_after)


def _latest(samples: list[Any]) -> tuple[dict[str, LatestMetric], list[LatestEvent]]:
    metrics: dict[str, LatestMetric] = {}
    events: list[LatestEvent] = []
    for sample in samples:  # newest first
        for name, value in msgspec.json.decode(sample["metrics"] or "{}").items():
            if name not in metrics:
                metrics[name] = LatestMetric(value=value, ts=sample["ts"])
        for event in msgspec.json.decode(sample["events"] or "[]"):
            if len(events) < LATEST_EVENTS_MAX:
                events.append(LatestEvent(event=str(event.get("type")), ts=sample["ts"]))
    return metrics, events


def _time_bound(which: str) -> Any:
    """The ``since``/``until`` parameter: samples ``which`` this device time."""
    return Parameter(
        description=f"Only samples {which} this device time (RFC 3339, with offset; {TIME_RANGE}).",
        schema_extra=exact("string", format="date-time", pattern=TIME_PATTERN),
    )


_Since = Annotated[datetime | None, _time_bound("at or after")]
_Until = Annotated[datetime | None, _time_bound("before")]
_Metric = Annotated[
    str | None,
    Parameter(
        pattern=_METRIC_PATTERN,
        schema_extra=exact("string"),
        description="Only samples carrying this metric.",
    ),
]
_Before = Annotated[
    str | None,
    Parameter(
        pattern=SAMPLE_CURSOR_PATTERN,
        schema_extra=exact("string"),
        description="Keyset cursor: only older samples (`next_before`).",
    ),
]


@route(
    "GET",
    "/devices/{id:str}",
    summary="One device, with its latest metrics and events",
    operation_id="getDevice",
    tag=TAG,
    role=Role.VIEWER,
    errors=[DEVICE_NOT_FOUND],
    description=(
        f"`latest_metrics` holds each metric's newest value among the device's newest "
        f"{LATEST_WINDOW} samples; `latest_events` their events, newest first, at most "
        f"{LATEST_EVENTS_MAX}. `clock` counts the samples judged at another time than their "
        "own (or ordered by `seq` against it), per reason, and shows the last one."
    ),
)
async def get_device(pool: Pool, alarms: Alarms, id: DeviceId) -> DeviceOne:
    return await _one(pool, alarms, id)


@route(
    "GET",
    "/device",
    summary="One device named in the query: a native or a Sparkplug id",
    operation_id="getDeviceById",
    tag=TAG,
    role=Role.VIEWER,
    errors=[DEVICE_NOT_FOUND],
    description=(
        "`GET /devices/{id}` for any device, Sparkplug ones included "
        "(`?id=Plant1%2FLine4%2FOven`), whose `/` no path can carry (an encoded `%2F` is "
        "decoded before routing)."
    ),
)
async def get_device_by_id(pool: Pool, alarms: Alarms, id: AnyDeviceId) -> DeviceOne:
    return await _one(pool, alarms, any_device_id(id))


async def _one(pool: Pool, alarms: Alarms, id: str) -> DeviceOne:
    """The device with its latest metrics and events, its clock figures, its out of service."""
    row = await repo.device(pool, id)
    if row is None:
        raise ApiError(DEVICE_NOT_FOUND, f"no device {id}", device_id=id)
    metrics, events = _latest(await repo.latest_samples(pool, id, LATEST_WINDOW))
    clock = _clock(await clock_repo.device_adjustments(pool, id))
    base = _device(row)
    period = await alarms.out_of_service(id)
    return DeviceOne(
        device=DeviceDetail(
            **{f: getattr(base, f) for f in Device.__struct_fields__},
            bound=row["bound"],
            out_of_service=None if period is None else from_row(OutOfService, period),
            latest_metrics=metrics,
            latest_events=events,
            clock=clock,
        )
    )


def _clock(figures: list[ClockFigure]) -> DeviceClockFigures:
    """The figures as the API shows them; `figures` come latest first."""
    counts = {f.reason: f.count for f in figures}
    if not figures:
        return DeviceClockFigures(adjustments=counts)
    last = figures[0]
    return DeviceClockFigures(
        adjustments=counts,
        last=ClockAdjustmentSeen(
            received_at=last.last_received_at,
            reason=last.reason,
            device_ts=last.last_device_ts,
            judged_ts=last.last_judged_ts,
            skew_s=(last.last_device_ts - last.last_judged_ts).total_seconds(),
        ),
    )


def _cursor_of(ts: datetime, event_id: str) -> str:
    return f"{(ts - _EPOCH) // timedelta(microseconds=1)}-{event_id}"


def _parse_cursor(text: str) -> tuple[datetime, str]:
    if _SAMPLE_CURSOR.match(text) is None:
        raise bad_request("before", "not a cursor this API gave (`next_before`)")
    micros, _, event_id = text.partition("-")
    try:
        return _EPOCH + timedelta(microseconds=int(micros)), event_id
    except OverflowError:  # beyond any stored time: everything is older
        return _LATEST, event_id


def _time(name: str, value: datetime | None) -> datetime | None:
    problem = None if value is None else time_problem(value)
    if problem is not None:
        raise bad_request(name, problem)
    return value


@route(
    "GET",
    "/devices/{id:str}/telemetry",
    summary="The device's stored samples, newest first (keyset pagination)",
    operation_id="getDeviceTelemetry",
    tag=TAG,
    role=Role.VIEWER,
    errors=[DEVICE_NOT_FOUND],
)
async def device_telemetry(
    pool: Pool,
    id: DeviceId,
    *,
    since: _Since = None,
    until: _Until = None,
    metric: _Metric = None,
    limit: Limit = LIMIT_DEFAULT,
    before: _Before = None,
) -> SamplePage:
    return await _telemetry(
        pool, id, since=since, until=until, metric=metric, limit=limit, before=before
    )


@route(
    "GET",
    "/device/telemetry",
    summary="The samples of a device named in the query: a native or a Sparkplug id",
    operation_id="getDeviceTelemetryById",
    tag=TAG,
    role=Role.VIEWER,
    errors=[DEVICE_NOT_FOUND],
    description=(
        "`GET /devices/{id}/telemetry` for any device, Sparkplug ones included "
        "(`?id=Plant1%2FLine4%2FOven`), whose `/` no path can carry."
    ),
)
async def device_telemetry_by_id(
    pool: Pool,
    id: AnyDeviceId,
    *,
    since: _Since = None,
    until: _Until = None,
    metric: _Metric = None,
    limit: Limit = LIMIT_DEFAULT,
    before: _Before = None,
) -> SamplePage:
    return await _telemetry(
        pool,
        any_device_id(id),
        since=since,
        until=until,
        metric=metric,
        limit=limit,
        before=before,
    )


async def _telemetry(
    pool: Pool,
    id: str,
    *,
    since: datetime | None,
    until: datetime | None,
    metric: str | None,
    limit: int,
    before: str | None,
) -> SamplePage:
    cursor = None if before is None else _parse_cursor(before)
    since, until = _time("since", since), _time("until", until)
    if await repo.device(pool, id) is None:
        raise ApiError(DEVICE_NOT_FOUND, f"no device {id}", device_id=id)
    rows = await repo.telemetry_page(
        pool, id, since=since, until=until, before=cursor, metric=metric, limit=limit + 1
    )
    page = rows[:limit]
    samples = [
        Sample(
            ts=r["ts"],
            seq=r["seq"],
            metrics=None if r["metrics"] is None else msgspec.json.decode(r["metrics"]),
            events=None if r["events"] is None else msgspec.json.decode(r["events"]),
            event_id=r["event_id"],
        )
        for r in page
    ]
    more = len(rows) > limit
    return SamplePage(
        items=samples,
        samples=samples,
        next_before=_cursor_of(page[-1]["ts"], page[-1]["event_id"]) if more else None,
    )


HANDLERS: Final = [
    list_devices,
    get_device,
    get_device_by_id,
    device_telemetry,
    device_telemetry_by_id,
]
