from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.domain.errors import ConfigError
from gateway.domain.quiet_hours import (
    DAYS,
    MERGE_HORIZON,
    QuietHours,
    QuietHoursConfig,
    QuietWindowConfig,
    compile_quiet_hours,
    held_back,
)

BERLIN = ZoneInfo("Europe/Berlin")
DEVICE = "dev-1"
SECOND = timedelta(seconds=1)
MICROSECOND = timedelta(microseconds=1)


def utc(y: int, mo: int, d: int, h: int = 0, mi: int = 0) -> datetime:
    return datetime(y, mo, d, h, mi, tzinfo=UTC)


def berlin(y: int, mo: int, d: int, h: int = 0, mi: int = 0, *, fold: int = 0) -> datetime:
    return datetime(y, mo, d, h, mi, tzinfo=BERLIN, fold=fold)


def window(**kw: Any) -> QuietWindowConfig:
    return QuietWindowConfig(**kw)


def hours(*windows: QuietWindowConfig, **kw: Any) -> QuietHours:
    return compile_quiet_hours(QuietHoursConfig(windows=list(windows), **kw))


def quiet(qh: QuietHours, at: datetime, *, device: str = DEVICE, severity: str = "MAJOR") -> bool:
    return qh.is_quiet(device_id=device, severity=severity, at=at)


def until(
    qh: QuietHours, at: datetime, *, device: str = DEVICE, severity: str = "MAJOR"
) -> datetime | None:
    return qh.quiet_until(device_id=device, severity=severity, at=at)


NIGHT_UTC = hours(window(start="22:00", end="07:00"))
LUNCH_UTC = hours(window(start="12:00", end="13:30"))


# --- configuration ---------------------------------------------------------------------------


def test_config_decodes_from_toml_with_defaults() -> None:
    config = msgspec.toml.decode(
        b"""
        [[windows]]
        start = "22:00"
        end = "07:00"

        [[windows]]
        devices = ["door-*", "lab-1"]
        start = "12:00"
        end = "13:00"
        timezone = "Europe/Berlin"
        days = ["sat", "sun"]
        """,
        type=QuietHoursConfig,
    )
    assert config.exempt_severities == ["CRITICAL"]
    assert config.windows[0] == QuietWindowConfig(start="22:00", end="07:00")
    assert config.windows[0].devices == "*"
    assert config.windows[0].timezone == "UTC"
    assert config.windows[0].days == []
    compiled = compile_quiet_hours(config)
    assert compiled.windows[1].days == frozenset({5, 6})
    assert compiled.windows[1].start == time(12)


def test_config_refuses_unknown_fields() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.toml.decode(b'start = "1:00"\nend = "2:00"\nzone = "UTC"', type=QuietWindowConfig)


def test_empty_config_is_never_quiet() -> None:
    qh = compile_quiet_hours(QuietHoursConfig())
    assert qh.windows == ()
    assert not quiet(qh, utc(2026, 1, 1, 3))
    assert until(qh, utc(2026, 1, 1, 3)) is None


@pytest.mark.parametrize(
    ("config", "key_path", "message"),
    [
        (
            QuietHoursConfig(windows=[window(start="7:00", end="08:00")]),
            "windows[0].start",
            "HH:MM",
        ),
        (QuietHoursConfig(windows=[window(start="07:00", end="24:00")]), "windows[0].end", "HH:MM"),
        (
            QuietHoursConfig(windows=[window(start="07:60", end="08:00")]),
            "windows[0].start",
            "HH:MM",
        ),
        (QuietHoursConfig(windows=[window(start="07:00", end="7h")]), "windows[0].end", "HH:MM"),
        (QuietHoursConfig(windows=[window(start="", end="08:00")]), "windows[0].start", "HH:MM"),
        (
            QuietHoursConfig(windows=[window(start="07:00", end="07:00:00")]),
            "windows[0].end",
            "HH:MM",
        ),
        (QuietHoursConfig(windows=[window(start="07:00", end="07:00")]), "windows[0].end", "empty"),
        (
            QuietHoursConfig(
                windows=[
                    window(start="22:00", end="06:00"),
                    window(start="22:00", end="06:00", timezone="Mars/Olympus_Mons"),
                ]
            ),
            "windows[1].timezone",
            "unknown time zone",
        ),
        (
            QuietHoursConfig(windows=[window(start="22:00", end="06:00", timezone="")]),
            "windows[0].timezone",
            "unknown time zone",
        ),
        (
            QuietHoursConfig(
                windows=[window(start="22:00", end="06:00", timezone="../etc/passwd")]
            ),
            "windows[0].timezone",
            "unknown time zone",
        ),
        (
            QuietHoursConfig(
                windows=[window(start="22:00", end="06:00", timezone="europe/berlin")]
            ),
            "windows[0].timezone",
            "unknown time zone",
        ),
        (
            QuietHoursConfig(windows=[window(start="22:00", end="06:00", days=["mon", "Tue"])]),
            "windows[0].days[1]",
            "unknown day 'Tue'",
        ),
        (
            QuietHoursConfig(windows=[window(start="22:00", end="06:00", days=["monday"])]),
            "windows[0].days[0]",
            "unknown day",
        ),
        (
            QuietHoursConfig(windows=[window(start="22:00", end="06:00", devices=[])]),
            "windows[0].devices",
            "must not be empty",
        ),
        (
            QuietHoursConfig(
                windows=[window(start="22:00", end="06:00", devices=["ok", "bad id"])]
            ),
            "windows[0].devices[1]",
            "invalid device id",
        ),
        (
            QuietHoursConfig(exempt_severities=["CRITICAL", "critical"]),
            "exempt_severities[1]",
            "unknown severity 'critical'",
        ),
    ],
)
def test_config_errors_name_the_key(config: QuietHoursConfig, key_path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        compile_quiet_hours(config)
    assert caught.value.key_path == f"alarms.quiet_hours.{key_path}"


def test_config_error_path_prefix_is_configurable() -> None:
    config = QuietHoursConfig(windows=[window(start="22:00", end="06:00", timezone="Nowhere")])
    with pytest.raises(ConfigError) as caught:
        compile_quiet_hours(config, "site.quiet")
    assert caught.value.key_path == "site.quiet.windows[0].timezone"


def test_unknown_time_zone_chains_the_zoneinfo_error() -> None:
    config = QuietHoursConfig(windows=[window(start="22:00", end="06:00", timezone="Nowhere")])
    with pytest.raises(ConfigError) as caught:
        compile_quiet_hours(config)
    assert isinstance(caught.value.__cause__, LookupError)


def test_naive_instants_are_refused() -> None:
    with pytest.raises(ValueError, match="tz-aware"):
        quiet(NIGHT_UTC, datetime(2026, 1, 1, 23))
    with pytest.raises(ValueError, match="tz-aware"):
        until(NIGHT_UTC, datetime(2026, 1, 1, 23))


# --- inside, outside, boundaries ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("at", "expected"),
    [
        (utc(2026, 5, 4, 12) - SECOND, False),
        (utc(2026, 5, 4, 12), True),  # start is inclusive
        (utc(2026, 5, 4, 12, 45), True),
        (utc(2026, 5, 4, 13, 30) - MICROSECOND, True),
        (utc(2026, 5, 4, 13, 30), False),  # end is exclusive
        (utc(2026, 5, 4, 18), False),
    ],
)
def test_window_within_one_day(at: datetime, expected: bool) -> None:
    assert quiet(LUNCH_UTC, at) is expected
    assert until(LUNCH_UTC, at) == (utc(2026, 5, 4, 13, 30) if expected else None)


@pytest.mark.parametrize(
    ("at", "expected"),
    [
        (utc(2026, 5, 4, 21, 59), False),
        (utc(2026, 5, 4, 22), True),
        (utc(2026, 5, 5) - SECOND, True),
        (utc(2026, 5, 5, 0), True),  # after midnight: the window that started on the 4th
        (utc(2026, 5, 5, 6, 59), True),
        (utc(2026, 5, 5, 7), False),
        (utc(2026, 5, 5, 12), False),
    ],
)
def test_window_spanning_midnight_on_both_sides(at: datetime, expected: bool) -> None:
    assert quiet(NIGHT_UTC, at) is expected
    assert until(NIGHT_UTC, at) == (utc(2026, 5, 5, 7) if expected else None)


def test_window_ending_at_midnight_spans_to_the_next_day() -> None:
    qh = hours(window(start="20:00", end="00:00"))
    assert quiet(qh, utc(2026, 5, 4, 23, 59))
    assert not quiet(qh, utc(2026, 5, 5, 0))
    assert until(qh, utc(2026, 5, 4, 20)) == utc(2026, 5, 5, 0)


def test_window_from_midnight() -> None:
    qh = hours(window(start="00:00", end="06:00"))
    assert not quiet(qh, utc(2026, 5, 4, 23, 59))
    assert quiet(qh, utc(2026, 5, 5, 0))
    assert until(qh, utc(2026, 5, 5, 0)) == utc(2026, 5, 5, 6)


def test_instants_in_other_offsets_are_compared_as_instants() -> None:
    # 23:30 in New York (EDT, -04:00) is 03:30 UTC the next day: inside 22:00-07:00 UTC.
    at = datetime(2026, 5, 4, 23, 30, tzinfo=ZoneInfo("America/New_York"))
    assert quiet(NIGHT_UTC, at)
    result = until(NIGHT_UTC, at)
    assert result == utc(2026, 5, 5, 7)
    assert result is not None
    assert result.tzinfo is UTC


# --- time zones ---------------------------------------------------------------------------------

BERLIN_NIGHT = hours(window(start="22:00", end="07:00", timezone="Europe/Berlin"))


@pytest.mark.parametrize(
    ("at", "expected"),
    [
        # Summer, CEST = UTC+2: quiet from 20:00 to 05:00 UTC.
        (utc(2026, 7, 1, 19, 59), False),
        (utc(2026, 7, 1, 20), True),
        (utc(2026, 7, 1, 21), True),  # 22:00 UTC would not be quiet yet
        (utc(2026, 7, 2, 4, 59), True),
        (utc(2026, 7, 2, 5), False),
        (utc(2026, 7, 2, 6), False),  # 06:00 UTC would still be quiet
        # Winter, CET = UTC+1: quiet from 21:00 to 06:00 UTC.
        (utc(2026, 1, 14, 20, 59), False),
        (utc(2026, 1, 14, 21), True),
        (utc(2026, 1, 14, 23), True),  # 00:00 local, the next day
        (utc(2026, 1, 15, 5, 59), True),
        (utc(2026, 1, 15, 6), False),
    ],
)
def test_berlin_night_checked_with_utc_instants(at: datetime, expected: bool) -> None:
    assert quiet(BERLIN_NIGHT, at) is expected


def test_berlin_night_quiet_until_is_utc() -> None:
    assert until(BERLIN_NIGHT, utc(2026, 7, 1, 23)) == utc(2026, 7, 2, 5)
    assert until(BERLIN_NIGHT, utc(2026, 1, 14, 23)) == utc(2026, 1, 15, 6)


def test_half_hour_offset_zone() -> None:
    qh = hours(window(start="09:00", end="10:00", timezone="Asia/Kolkata"))  # UTC+05:30
    assert not quiet(qh, utc(2026, 5, 4, 3, 29))
    assert quiet(qh, utc(2026, 5, 4, 3, 30))
    assert until(qh, utc(2026, 5, 4, 3, 30)) == utc(2026, 5, 4, 4, 30)


# --- days -----------------------------------------------------------------------------------


def test_days_names_the_start_day() -> None:
    # 2026-05-08 is a Friday.
    qh = hours(window(start="22:00", end="07:00", days=["fri", "sat"]))
    assert not quiet(qh, utc(2026, 5, 7, 23))  # Thursday night
    assert not quiet(qh, utc(2026, 5, 8, 3))  # Friday morning: Thursday's window
    assert quiet(qh, utc(2026, 5, 8, 22))  # Friday night
    assert quiet(qh, utc(2026, 5, 9, 3))  # Saturday morning: Friday's window
    assert quiet(qh, utc(2026, 5, 10, 6, 59))  # Sunday morning: Saturday's window
    assert not quiet(qh, utc(2026, 5, 10, 22))  # Sunday night
    assert not quiet(qh, utc(2026, 5, 11, 3))  # Monday morning: Sunday's window


def test_days_follow_the_window_time_zone() -> None:
    # 2026-05-08 22:30 UTC is already Saturday 00:30 in Berlin: Saturday's window, not Friday's.
    qh = hours(window(start="00:00", end="06:00", timezone="Europe/Berlin", days=["sat"]))
    assert quiet(qh, utc(2026, 5, 8, 22, 30))
    assert not quiet(qh, utc(2026, 5, 8, 21, 30))


def test_every_day_listed_equals_no_days() -> None:
    every = hours(window(start="22:00", end="07:00", days=list(DAYS)))
    for day in range(1, 8):
        at = utc(2026, 5, day, 23)
        assert quiet(every, at) is quiet(NIGHT_UTC, at) is True


# --- severities and devices -------------------------------------------------------------------


def test_critical_is_exempt_by_default() -> None:
    at = utc(2026, 5, 4, 23)
    for severity in ("INFO", "WARNING", "MAJOR"):
        assert quiet(NIGHT_UTC, at, severity=severity)
    assert not quiet(NIGHT_UTC, at, severity="CRITICAL")
    assert until(NIGHT_UTC, at, severity="CRITICAL") is None


def test_exempt_severities_are_configurable() -> None:
    qh = hours(window(start="22:00", end="07:00"), exempt_severities=["WARNING", "CRITICAL"])
    at = utc(2026, 5, 4, 23)
    assert not quiet(qh, at, severity="WARNING")
    assert quiet(qh, at, severity="MAJOR")
    nothing_exempt = hours(window(start="22:00", end="07:00"), exempt_severities=[])
    assert quiet(nothing_exempt, at, severity="CRITICAL")


def test_device_selectors() -> None:
    qh = hours(
        window(devices="door-*", start="22:00", end="07:00"),
        window(devices=["lab-1", "cam-?"], start="12:00", end="13:00"),
    )
    night, noon = utc(2026, 5, 4, 23), utc(2026, 5, 4, 12, 30)
    assert quiet(qh, night, device="door-7")
    assert not quiet(qh, noon, device="door-7")
    assert not quiet(qh, night, device="lab-1")
    assert quiet(qh, noon, device="lab-1")
    assert quiet(qh, noon, device="cam-3")
    assert not quiet(qh, noon, device="cam-33")
    assert not quiet(qh, noon, device="lab-10")
    assert not quiet(qh, night, device="Door-7")  # case-sensitive, like rules
    assert until(qh, night, device="lab-1") is None


# --- quiet_until and merging ------------------------------------------------------------------


def test_overlapping_windows_merge() -> None:
    qh = hours(window(start="22:00", end="02:00"), window(start="01:00", end="06:00"))
    assert until(qh, utc(2026, 5, 4, 22)) == utc(2026, 5, 5, 6)
    assert until(qh, utc(2026, 5, 5, 1, 30)) == utc(2026, 5, 5, 6)
    assert until(qh, utc(2026, 5, 5, 5)) == utc(2026, 5, 5, 6)


def test_adjacent_windows_merge() -> None:
    qh = hours(
        window(start="22:00", end="00:00"),
        window(start="00:00", end="03:00", devices="dev-*"),
        window(start="03:00", end="05:00", timezone="Europe/Berlin"),  # 01:00-03:00 UTC in May
        window(start="06:00", end="07:00"),  # a gap of an hour before it: not merged
    )
    assert until(qh, utc(2026, 5, 4, 22)) == utc(2026, 5, 5, 3)
    assert until(qh, utc(2026, 5, 4, 22), device="other") == utc(2026, 5, 5, 0)
    assert not quiet(qh, utc(2026, 5, 5, 3))
    assert until(qh, utc(2026, 5, 5, 6)) == utc(2026, 5, 5, 7)


def test_windows_covering_the_whole_week_never_end() -> None:
    qh = hours(window(start="00:00", end="12:00"), window(start="12:00", end="00:00"))
    at = utc(2026, 5, 4, 9, 17)
    result = until(qh, at)
    assert result is not None
    assert result - at >= MERGE_HORIZON
    assert quiet(qh, result)


def test_merging_across_days_with_a_days_filter() -> None:
    # Friday 18:00 through Monday 06:00 by three windows; 2026-05-08 is a Friday.
    qh = hours(
        window(start="18:00", end="00:00", days=["fri"]),
        window(start="00:00", end="23:59", days=["sat", "sun"]),
        window(start="23:59", end="06:00", days=["sat", "sun"]),
    )
    assert until(qh, utc(2026, 5, 8, 19)) == utc(2026, 5, 11, 6)
    assert not quiet(qh, utc(2026, 5, 11, 6))


# --- daylight saving time -------------------------------------------------------------------
# Europe/Berlin 2026: clocks go from 02:00 CET to 03:00 CEST on 2026-03-29 (01:00 UTC) and from
# 03:00 CEST back to 02:00 CET on 2026-10-25 (01:00 UTC).


def test_spring_forward_window_inside_the_gap_does_not_exist() -> None:
    qh = hours(window(start="02:00", end="03:00", timezone="Europe/Berlin"))
    for minute in range(-90, 91, 5):
        at = utc(2026, 3, 29, 1) + timedelta(minutes=minute)
        assert not quiet(qh, at)
    # ... but the day before and after it does.
    assert until(qh, berlin(2026, 3, 28, 2)) == utc(2026, 3, 28, 2)
    assert until(qh, berlin(2026, 3, 30, 2)) == utc(2026, 3, 30, 1)


def test_spring_forward_start_inside_the_gap_starts_when_the_gap_ends() -> None:
    qh = hours(window(start="02:30", end="06:00", timezone="Europe/Berlin"))
    assert not quiet(qh, utc(2026, 3, 29, 1) - SECOND)  # 01:59:59 CET
    assert quiet(qh, utc(2026, 3, 29, 1))  # 03:00 CEST
    assert until(qh, utc(2026, 3, 29, 1)) == berlin(2026, 3, 29, 6) == utc(2026, 3, 29, 4)


def test_spring_forward_end_inside_the_gap_ends_when_the_gap_ends() -> None:
    qh = hours(window(start="22:00", end="02:30", timezone="Europe/Berlin"))
    assert until(qh, berlin(2026, 3, 28, 22)) == utc(2026, 3, 29, 1)  # 03:00 CEST
    assert not quiet(qh, utc(2026, 3, 29, 1))


def test_spring_forward_night_window_is_an_hour_shorter() -> None:
    start = berlin(2026, 3, 28, 22)
    end = until(BERLIN_NIGHT, start)
    assert end == berlin(2026, 3, 29, 7) == utc(2026, 3, 29, 5)
    assert end - start == timedelta(hours=8)


def test_fall_back_ambiguous_hour_is_quiet_on_both_passes() -> None:
    qh = hours(window(start="02:00", end="03:00", timezone="Europe/Berlin"))
    first_pass = berlin(2026, 10, 25, 2, 15, fold=0)
    second_pass = berlin(2026, 10, 25, 2, 15, fold=1)
    assert first_pass.astimezone(UTC) == utc(2026, 10, 25, 0, 15)
    assert second_pass.astimezone(UTC) == utc(2026, 10, 25, 1, 15)
    assert not quiet(qh, utc(2026, 10, 24, 23, 59))
    assert quiet(qh, first_pass)
    assert quiet(qh, second_pass)
    # One occurrence: from the first 02:00 to the (only) 03:00, two hours of real time.
    assert until(qh, first_pass) == utc(2026, 10, 25, 2)
    assert not quiet(qh, utc(2026, 10, 25, 2))


def test_fall_back_end_inside_the_ambiguous_hour_is_its_last_pass() -> None:
    qh = hours(window(start="01:00", end="02:30", timezone="Europe/Berlin"))
    assert quiet(qh, berlin(2026, 10, 25, 2, 45, fold=0))  # between the two 02:30s
    assert quiet(qh, berlin(2026, 10, 25, 2, 29, fold=1))
    # (Aware datetimes in a repeated hour never compare equal across zones: convert first.)
    second_half_past_two = berlin(2026, 10, 25, 2, 30, fold=1).astimezone(UTC)
    assert second_half_past_two == utc(2026, 10, 25, 1, 30)
    assert until(qh, berlin(2026, 10, 25, 1)) == second_half_past_two
    assert not quiet(qh, berlin(2026, 10, 25, 2, 30, fold=1))


def test_fall_back_start_inside_the_ambiguous_hour_is_its_first_pass() -> None:
    qh = hours(window(start="02:30", end="04:00", timezone="Europe/Berlin"))
    assert not quiet(qh, berlin(2026, 10, 25, 2, 29, fold=0))
    assert quiet(qh, berlin(2026, 10, 25, 2, 30, fold=0))
    assert quiet(qh, berlin(2026, 10, 25, 2, 15, fold=1))  # before 02:30, but on the second pass
    assert until(qh, berlin(2026, 10, 25, 2, 30, fold=0)) == utc(2026, 10, 25, 3)


def test_fall_back_night_window_is_an_hour_longer() -> None:
    start = berlin(2026, 10, 24, 22)
    end = until(BERLIN_NIGHT, start)
    assert end == berlin(2026, 10, 25, 7) == utc(2026, 10, 25, 6)
    assert end - start == timedelta(hours=10)


def test_occurrence_is_empty_inside_a_gap_and_absent_on_other_days() -> None:
    qh = hours(window(start="02:00", end="03:00", timezone="Europe/Berlin", days=["sun"]))
    (compiled,) = qh.windows
    assert compiled.occurrence(date(2026, 3, 29)) == (utc(2026, 3, 29, 1), utc(2026, 3, 29, 1))
    assert compiled.occurrence(date(2026, 3, 28)) is None  # a Saturday


def test_a_zone_that_skipped_a_whole_day() -> None:
    # Samoa moved across the date line: 2011-12-29 23:59:59 -10:00 was followed by
    # 2011-12-31 00:00:00 +14:00, so 2011-12-30 never happened there.
    qh = hours(window(start="12:00", end="13:00", timezone="Pacific/Apia"))
    (compiled,) = qh.windows
    gap_end = utc(2011, 12, 30, 10)
    assert compiled.occurrence(date(2011, 12, 30)) == (gap_end, gap_end)
    assert not quiet(qh, gap_end)
    # 2011-12-31 12:00 +14:00 is 2011-12-30 22:00 UTC.
    assert until(qh, utc(2011, 12, 30, 22, 30)) == utc(2011, 12, 30, 23)
    assert until(qh, utc(2011, 12, 30, 23)) is None


# --- properties ---------------------------------------------------------------------------------

ZONES = (
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe",  # a 30-minute DST shift
    "Asia/Kolkata",
    "America/Santiago",  # DST transitions at midnight
    "Pacific/Apia",
)
FIXED_ZONES = ("UTC", "Asia/Kolkata", "Asia/Tokyo", "Etc/GMT+5")

hh_mm = st.builds("{:02d}:{:02d}".format, st.integers(0, 23), st.sampled_from([0, 1, 15, 30, 59]))


@st.composite
def window_configs(draw: st.DrawFn, zones: tuple[str, ...] = ZONES) -> QuietWindowConfig:
    start = draw(hh_mm)
    end = draw(hh_mm.filter(lambda end: end != start))
    days = draw(st.lists(st.sampled_from(DAYS), max_size=3, unique=True))
    return QuietWindowConfig(start=start, end=end, timezone=draw(st.sampled_from(zones)), days=days)


instants = st.datetimes(
    min_value=datetime(2010, 1, 1),
    max_value=datetime(2035, 12, 31),
    timezones=st.just(UTC),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(window_configs(), min_size=1, max_size=3), instants, st.floats(0, 1, exclude_max=True)
)
def test_quiet_until_agrees_with_is_quiet(
    windows: list[QuietWindowConfig], at: datetime, fraction: float
) -> None:
    qh = compile_quiet_hours(QuietHoursConfig(windows=windows))
    end = until(qh, at)
    assert quiet(qh, at) is (end is not None)
    if end is None:
        return
    assert end > at
    assert end.tzinfo is UTC
    # The merged period is contiguous: quiet all the way, and over at its end.
    assert quiet(qh, min(at + (end - at) * fraction, end - MICROSECOND))
    assert quiet(qh, end - MICROSECOND)
    if end - at < MERGE_HORIZON:
        assert not quiet(qh, end)
        assert until(qh, end) is None


def _naive_is_quiet(config: QuietWindowConfig, at: datetime) -> bool:
    """An oracle for zones without DST: compare the wall clock with the window."""
    local = at.astimezone(ZoneInfo(config.timezone)).replace(tzinfo=None)
    start, end = time.fromisoformat(config.start), time.fromisoformat(config.end)
    days = {DAYS.index(day) for day in config.days} or set(range(7))
    today, yesterday = local.weekday(), (local.weekday() - 1) % 7
    if start < end:
        return today in days and start <= local.time() < end
    return (today in days and local.time() >= start) or (yesterday in days and local.time() < end)


@settings(max_examples=300, deadline=None)
@given(window_configs(FIXED_ZONES), instants)
def test_is_quiet_matches_the_wall_clock_without_dst(
    config: QuietWindowConfig, at: datetime
) -> None:
    qh = compile_quiet_hours(QuietHoursConfig(windows=[config]))
    assert quiet(qh, at) is _naive_is_quiet(config, at)


# --- what quiet hours hold back ---------------------------------------------------------------


def test_no_quiet_hours_hold_nothing_back() -> None:
    """A reload that removes the last window leaves `None`: what was delayed is due at once."""
    at = utc(2026, 5, 4, 23)
    assert not held_back(None, device_id=DEVICE, severity="MAJOR", at=at)
    assert held_back(NIGHT_UTC, device_id=DEVICE, severity="MAJOR", at=at)
    assert not held_back(NIGHT_UTC, device_id=DEVICE, severity="CRITICAL", at=at)
    assert not held_back(NIGHT_UTC, device_id=DEVICE, severity="MAJOR", at=utc(2026, 5, 5, 7))


def test_a_night_of_reminder_passes_holds_every_one_until_the_window_ends() -> None:
    """Passes every minute through a 22:00-07:00 night with reminders due every 10 minutes:
    each one is held, so the first that is not (07:00) makes the one reminder of the night."""
    interval = timedelta(minutes=10)
    last = utc(2026, 5, 4, 21, 55)
    made = []
    at = last
    while at <= utc(2026, 5, 5, 7, 5):
        if at - last >= interval and not held_back(
            NIGHT_UTC, device_id=DEVICE, severity="MAJOR", at=at
        ):
            made.append(at)
            last = at
        at += timedelta(minutes=1)
    assert made == [utc(2026, 5, 5, 7)]
