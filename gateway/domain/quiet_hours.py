"""Quiet hours (docs/behaviour.md §5): local wall-clock windows in which new alarms wait.

Pure: no I/O beyond loading time zone data at compile time, and no clock reads (``at`` is
always a parameter). Results are UTC, tz-aware.

A window is ``[start, end)`` in the wall-clock time of its time zone; ``end < start`` spans
midnight, and the part after midnight belongs to the window that started the day before, so
``days`` names the day a window *starts* on. One occurrence of a window is one contiguous
interval of instants, from the first moment the clock shows ``start`` to the last moment it
shows ``end``. Across daylight-saving changes that means:

- **Spring forward** (the clock skips, say, 02:00-03:00): a wall time inside the gap stands for
  the instant the gap ends, the first instant whose wall time is not before it. A window
  02:00-03:00 on that day is empty; 02:30-06:00 starts at 03:00; 01:00-02:30 ends at 03:00
  (after one hour of real time).
- **Fall back** (the clock shows, say, 02:00-03:00 twice): ``start`` is its first occurrence and
  ``end`` its last, so the window is quiet on both passes. 01:00-02:30 lasts from the first
  01:00 to the second 02:30, including the first pass's 02:30-03:00.

Overlapping and adjacent occurrences (of one window or several) merge into one quiet period;
`QuietHours.quiet_until` returns the end of that period.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec

from gateway.domain.errors import ConfigError

# `device_selector` checks device ids and globs exactly as rules do: shared, not copied.
from gateway.domain.rules import SEVERITIES, DeviceSelector, device_selector

DAYS: Final[tuple[str, ...]] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
# A quiet period still not over this long after `at` is taken as never ending (windows that
# cover the clock all week): `quiet_until` stops merging there and the caller checks again then.
# More than a week, so that every period that does end is found.
MERGE_HORIZON: Final = timedelta(days=8)

_HH_MM_RE: Final = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])\Z")
_DAY_INDEX: Final = {name: index for index, name in enumerate(DAYS)}  # date.weekday() order
_ONE_DAY: Final = timedelta(days=1)
# The local dates whose occurrences can contain an instant, relative to that instant's local
# date: an occurrence ends before its start date + 2, and DST moves things by hours, not days.
_DAY_OFFSETS: Final = tuple(timedelta(days=n) for n in (-2, -1, 0, 1))


class QuietWindowConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One `[[alarms.quiet_hours.windows]]` table; `compile_quiet_hours` validates it."""

    devices: str | list[str] = "*"
    start: str  # "HH:MM", local time
    end: str  # "HH:MM", local time; before `start`: the window spans midnight
    timezone: str = "UTC"  # IANA name
    # The days the window starts on ("mon".."sun"); empty: every day.
    days: list[str] = msgspec.field(default_factory=list)


class QuietHoursConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The `[alarms.quiet_hours]` table; exempt severities are never delayed."""

    windows: list[QuietWindowConfig] = msgspec.field(default_factory=list)
    exempt_severities: list[str] = msgspec.field(default_factory=lambda: ["CRITICAL"])


@dataclass(frozen=True, kw_only=True)
class QuietWindow:
    """A validated window; build them with `compile_quiet_hours`."""

    selector: DeviceSelector
    start: time
    end: time
    zone: ZoneInfo
    days: frozenset[int]  # date.weekday() numbers; empty: every day

    def occurrence(self, day: date) -> tuple[datetime, datetime] | None:
        """The UTC interval ``[start, end)`` of the window starting on local `day`, if it does.

        The interval is empty (``start == end``) when it falls wholly into a DST gap.
        """
        if self.days and day.weekday() not in self.days:
            return None
        end_day = day + _ONE_DAY if self.end < self.start else day
        start = _to_utc(datetime.combine(day, self.start), self.zone, last=False)
        end = _to_utc(datetime.combine(end_day, self.end), self.zone, last=True)
        return start, end

    def occurrences_around(self, instant: datetime) -> Iterator[tuple[datetime, datetime]]:
        """Every non-empty occurrence that may contain `instant` (and possibly a few others)."""
        local_day = instant.astimezone(self.zone).date()
        for offset in _DAY_OFFSETS:
            interval = self.occurrence(local_day + offset)
            if interval is not None and interval[0] < interval[1]:
                yield interval


@dataclass(frozen=True, kw_only=True)
class QuietHours:
    """The compiled quiet hours; build them with `compile_quiet_hours`."""

    windows: tuple[QuietWindow, ...] = ()
    exempt_severities: frozenset[str] = frozenset({"CRITICAL"})

    def is_quiet(self, *, device_id: str, severity: str, at: datetime) -> bool:
        """Whether an alarm of `device_id` and `severity` raised `at` is to be delayed."""
        at = _as_utc(at)
        return any(
            start <= at < end for start, end in self._intervals_around(device_id, severity, at)
        )

    def quiet_until(self, *, device_id: str, severity: str, at: datetime) -> datetime | None:
        """When the quiet period covering `at` ends (UTC), or None if `at` is not quiet.

        Overlapping and adjacent windows merge: at the returned instant it is not quiet any
        more, unless the period has not ended within `MERGE_HORIZON` (see there).
        """
        at = _as_utc(at)
        until: datetime | None = None
        probe = at
        while True:
            ends = [
                end
                for start, end in self._intervals_around(device_id, severity, probe)
                if start <= probe < end
            ]
            if not ends:
                return until
            until = max(ends)
            if until - at >= MERGE_HORIZON:
                return until
            probe = until

    def _intervals_around(
        self, device_id: str, severity: str, instant: datetime
    ) -> Iterator[tuple[datetime, datetime]]:
        if severity in self.exempt_severities:
            return
        for window in self.windows:
            if window.selector.matches(device_id):
                yield from window.occurrences_around(instant)


def held_back(quiet: QuietHours | None, *, device_id: str, severity: str, at: datetime) -> bool:
    """Whether quiet hours hold back a push or a reminder of this alarm `at`.

    No quiet hours (none configured, or a reload removed the last window) hold nothing back:
    an alarm delayed under a window that is gone is due at once, not stranded.
    """
    return quiet is not None and quiet.is_quiet(device_id=device_id, severity=severity, at=at)


def compile_quiet_hours(config: QuietHoursConfig, path: str = "alarms.quiet_hours") -> QuietHours:
    """Validate `config`; a `ConfigError` names the offending key (`...windows[1].timezone`)."""
    windows = tuple(
        _compile_window(window, f"{path}.windows[{index}]")
        for index, window in enumerate(config.windows)
    )
    for index, severity in enumerate(config.exempt_severities):
        if severity not in SEVERITIES:
            raise ConfigError(
                f"{path}.exempt_severities[{index}]",
                f"unknown severity {severity!r}; expected {' | '.join(SEVERITIES)}",
            )
    return QuietHours(windows=windows, exempt_severities=frozenset(config.exempt_severities))


def _compile_window(config: QuietWindowConfig, path: str) -> QuietWindow:
    selector = device_selector(config.devices, f"{path}.devices")
    start = _hh_mm(config.start, f"{path}.start")
    end = _hh_mm(config.end, f"{path}.end")
    if start == end:
        raise ConfigError(f"{path}.end", f"equals start ({config.start}): the window is empty")
    return QuietWindow(
        selector=selector,
        start=start,
        end=end,
        zone=_zone(config.timezone, f"{path}.timezone"),
        days=_days(config.days, f"{path}.days"),
    )


def _hh_mm(value: str, path: str) -> time:
    match = _HH_MM_RE.fullmatch(value)
    if match is None:
        raise ConfigError(path, f'invalid time {value!r}; expected "HH:MM" from 00:00 to 23:59')
    return time(int(match[1]), int(match[2]))


def _zone(name: str, path: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as error:
        # ValueError: a key that is not a relative path ("", "/etc/localtime", "../x").
        raise ConfigError(
            path, f'unknown time zone {name!r}; expected an IANA name like "Europe/Berlin"'
        ) from error


def _days(names: Sequence[str], path: str) -> frozenset[int]:
    days = set()
    for index, name in enumerate(names):
        day = _DAY_INDEX.get(name)
        if day is None:
            raise ConfigError(
                f"{path}[{index}]", f"unknown day {name!r}; expected {' | '.join(DAYS)}"
            )
        days.add(day)
    return frozenset(days)


def _as_utc(at: datetime) -> datetime:
    # In UTC, comparisons are plain: across zones, PEP 495 makes an instant in a repeated hour
    # unequal to everything, itself included.
    if at.utcoffset() is None:
        raise ValueError(f"`at` must be tz-aware, got {at!r}")
    return at.astimezone(UTC)


def _to_utc(local: datetime, zone: ZoneInfo, *, last: bool) -> datetime:
    """The UTC instant of naive wall time `local` in `zone`; see the module doc for DST.

    An ambiguous wall time (fall back) gives its first instant, or its last if `last`; a wall
    time that does not exist (spring forward) gives the instant the gap ends.
    """
    # PEP 495: fold=0 applies the offset in force before a transition, fold=1 the one after.
    # They agree for an ordinary time, order the two instants of an ambiguous one, and give
    # the wrong order for a time inside a gap, which lies between the two.
    first = local.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = local.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if first <= second:
        return second if last else first
    return _transition(zone, before=second, after=first)


def _transition(zone: ZoneInfo, *, before: datetime, after: datetime) -> datetime:
    """The first instant in ``(before, after]`` with the offset in force at `after`.

    Time zone transitions fall on whole seconds; a bisection over the seconds of a gap (an hour
    or so) takes a dozen steps, and gaps are met at most twice a year per window.
    """
    offset_before = before.astimezone(zone).utcoffset()
    low, high = int(before.timestamp()), int(after.timestamp())
    while high - low > 1:
        middle = (low + high) // 2
        if datetime.fromtimestamp(middle, UTC).astimezone(zone).utcoffset() == offset_before:
            low = middle
        else:
            high = middle
    return datetime.fromtimestamp(high, UTC)
