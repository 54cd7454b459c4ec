"""[retention] settings and the day arithmetic of the maintenance pass."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone

import pytest

from gateway.config import RetentionConfig, parse_config
from gateway.domain.errors import ConfigError
from gateway.maintenance.runner import days_ahead, telemetry_cutoff


def test_defaults_keep_a_month_of_telemetry_and_make_a_week_ahead() -> None:
    retention = parse_config("").retention
    assert retention == RetentionConfig()
    assert (retention.telemetry_days, retention.partitions_ahead_days) == (30, 7)
    assert retention.interval_s == 3600.0


def test_zero_keeps_forever_and_is_accepted() -> None:
    text = "[retention]\n" + "\n".join(
        f"{key} = 0"
        for key in (
            "telemetry_days",
            "dead_letter_days",
            "audit_days",
            "receipts_days",
            "outbox_days",
            "ai_payload_days",
        )
    )
    assert parse_config(text).retention.telemetry_days == 0


@pytest.mark.parametrize(
    ("line", "path"),
    [
        ("telemetry_days = -1", "retention.telemetry_days"),
        ("audit_days = 1.5", "retention.audit_days"),
        ("partitions_ahead_days = 0", "retention.partitions_ahead_days"),
        ("interval_s = 1", "retention.interval_s"),
        ("keep = 3", "retention.keep"),
    ],
)
def test_bad_settings_name_their_key(line: str, path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"[retention]\n{line}\n")
    assert caught.value.key_path == path


def test_a_day_goes_once_all_of_it_is_older_than_the_window() -> None:
    now = datetime(2026, 3, 31, 12, 0, tzinfo=UTC)
    assert telemetry_cutoff(now, 30) == datetime(2026, 3, 1, tzinfo=UTC)
    # Just after midnight the day before is still partly inside.
    assert telemetry_cutoff(datetime(2026, 3, 31, 0, 1, tzinfo=UTC), 1) == datetime(
        2026, 3, 30, tzinfo=UTC
    )
    # Days are UTC days, whatever the clock's zone.
    east = now.astimezone(timezone(timedelta(hours=14)))
    assert telemetry_cutoff(east, 30) == telemetry_cutoff(now, 30)


def test_partitions_ahead_are_today_and_the_days_after() -> None:
    late = datetime(2026, 12, 31, 23, 59, tzinfo=UTC)
    assert days_ahead(late, 2) == [date(2026, 12, 31), date(2027, 1, 1), date(2027, 1, 2)]
