"""The rule watch and a rule a reload removes and a later reload adds again, still
misspelled: "a reload that adds the rule starts its wait again" (docs/operations.md), and
after that wait the rule is reported again. It was remembered as reported for the life of
the process, and never logged again."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
from structlog.testing import capture_logs

from gateway.alarms.rule_watch import RuleWatch
from gateway.config import parse_config
from gateway.domain.rules import RuleSet
from tests.integration.services.test_rule_watch import FixedClock

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
DAMP = """
[[rules]]
key = "damp"
kind = "threshold"
severity = "WARNING"
metric = "humidty"
op = ">"
value = 80
"""
OTHER = """
[[rules]]
key = "door"
kind = "event"
severity = "MAJOR"
event = "DOOR_OPEN"
"""


async def test_a_rule_removed_and_added_again_is_reported_again_after_its_wait(
    pool: asyncpg.Pool,
) -> None:
    rules: RuleSet = parse_config(DAMP + OTHER).rule_set()
    clock = FixedClock(NOW)
    watch = RuleWatch(pool=pool, rules=lambda: rules, after_s=600, clock=clock)
    with capture_logs() as logs:
        await watch.run_once()
        clock.now += timedelta(seconds=600)
        await watch.run_once()  # both reported: no telemetry at all
        rules = parse_config(OTHER).rule_set()  # a reload removes damp
        clock.now += timedelta(seconds=60)
        await watch.run_once()
        rules = parse_config(DAMP + OTHER).rule_set()  # a reload adds it again, misspelled
        clock.now += timedelta(seconds=60)
        await watch.run_once()  # its wait starts again
        clock.now += timedelta(seconds=600)
        again = await watch.run_once()
    reported = [e["rule"] for e in logs if e["event"] == "rule_never_matched"]
    assert [r.rule_key for r in again] == ["damp"], f"logged: {reported}"
    assert sorted(reported) == ["damp", "damp", "door"]
