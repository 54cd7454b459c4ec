"""The pure part of the rule check: which name a rule watches, the closest seen names."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.domain.rule_check import WatchedName, closest, unseen, watched_names


def test_misspellings_find_their_closest_seen_names() -> None:
    assert closest("humidty", {"humidity", "temp", "battery"}) == ("humidity",)
    assert closest("DOOR_OPNE", {"DOOR_OPEN", "DOOR_CLOSE", "FIRE"})[0] == "DOOR_OPEN"
    assert closest("pressure", {"temp"}) == ()


def test_a_metric_rule_is_judged_against_metrics_and_an_event_rule_against_events() -> None:
    metric = WatchedName("r", "metric", "DOOR_OPEN")
    # The same word among events does not make a metric seen.
    report = unseen(metric, seen_metrics={"temp"}, seen_events={"DOOR_OPEN"})
    assert report is not None
    assert report.closest == ()
    assert (
        unseen(WatchedName("e", "event", "DOOR_OPEN"), seen_metrics=(), seen_events={"DOOR_OPEN"})
        is None
    )


def test_inactivity_rules_watch_no_name() -> None:
    config = parse_config(
        '[[rules]]\nkey = "quiet"\nkind = "inactivity"\nseverity = "WARNING"\nsilent_seconds = 5\n'
    )
    assert watched_names(config.rule_set()) == []
