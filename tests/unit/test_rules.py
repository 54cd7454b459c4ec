from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import ConfigError
from gateway.rules import (
    CLEARED_BY,
    Clearing,
    DeviceSelector,
    Evaluation,
    EventRule,
    Firing,
    FiringState,
    InactivityRule,
    RuleConfig,
    RuleSet,
    StagedState,
    ThresholdRule,
    compile_rules,
    evaluate,
    inactivity_firing,
)
from protocol import Telemetry

T0 = datetime(2025, 1, 1, tzinfo=UTC)
T0_MS = int(T0.timestamp() * 1000)

EXAMPLE = b"""
[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
devices = "*"
description = "a door opened"

[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
for_samples = 1
for_seconds = 0
severity = "CRITICAL"
devices = ["lab-1", "freezer-*"]

[[rules]]
key = "silent"
kind = "inactivity"
silent_seconds = 300
severity = "WARNING"
"""


class _File(msgspec.Struct, forbid_unknown_fields=True):
    rules: list[RuleConfig] = []


def from_toml(text: bytes) -> RuleSet:
    return compile_rules(msgspec.toml.decode(text, type=_File).rules)


def rules_of(*tables: dict[str, Any]) -> RuleSet:
    return compile_rules([msgspec.convert(table, RuleConfig) for table in tables])


def event_rule(key: str, event: str, **extra: Any) -> dict[str, Any]:
    return {"key": key, "kind": "event", "event": event, "severity": "MAJOR", **extra}


def threshold(key: str = "temp-high", **extra: Any) -> dict[str, Any]:
    table = {"key": key, "kind": "threshold", "metric": "temp", "op": ">", "value": 80}
    return {**table, "severity": "CRITICAL", **extra}


def inactivity(key: str = "silent", **extra: Any) -> dict[str, Any]:
    return {"key": key, "kind": "inactivity", "silent_seconds": 300, "severity": "WARNING", **extra}


def events(*types: str, at_s: float = 0) -> Telemetry:
    return Telemetry(ts=T0_MS + int(at_s * 1000), events=[{"type": t} for t in types])


def sample(at_s: float = 0, **metrics: int | float | bool | str) -> Telemetry:
    return Telemetry(ts=T0_MS + int(at_s * 1000), metrics=metrics)


class Feed:
    """Evaluates messages one at a time, applying each evaluation as a commit would."""

    def __init__(self, rules: RuleSet, state: FiringState | None = None) -> None:
        self.rules = rules
        self.state = state or FiringState()
        self.count = 0

    def __call__(self, message: Telemetry, device_id: str = "dev-1") -> Evaluation:
        self.count += 1
        evaluation = evaluate(self.rules, self.state, device_id, f"ev-{self.count}", message)
        self.state.apply(evaluation)
        return evaluation


def kinds(evaluation: Evaluation) -> list[tuple[str, str]]:
    return [(type(o).__name__, o.rule_key) for o in evaluation.outcomes]


# --- configuration ----------------------------------------------------------------------


def test_example_compiles_with_defaults() -> None:
    rules = from_toml(EXAMPLE)
    assert [rule.key for rule in rules] == ["door-open", "temp-high", "silent"]
    door, temp, silent = rules.rules
    assert isinstance(door, EventRule)
    assert door.kind == "event"
    assert door.event == "DOOR_OPEN"
    assert door.severity == "MAJOR"
    assert door.description == "a door opened"
    assert isinstance(temp, ThresholdRule)
    assert (temp.kind, temp.metric, temp.op, temp.value, temp.clear_value) == (
        "threshold",
        "temp",
        ">",
        80,
        75,
    )
    assert (temp.for_samples, temp.for_seconds) == (1, 0.0)
    assert isinstance(silent, InactivityRule)
    assert silent.silent_seconds == 300.0
    assert rules.inactivity_rules == (silent,)
    assert rules.by_key("temp-high") is temp
    assert rules.by_key("nope") is None
    assert rules.event_rules_for("DOOR_OPEN") == (door,)
    assert rules.event_rules_for("SMOKE") == ()


def test_threshold_defaults_without_hysteresis() -> None:
    (rule,) = rules_of(threshold()).rules
    assert isinstance(rule, ThresholdRule)
    assert (rule.clear_value, rule.for_samples, rule.for_seconds) == (80, 1, 0.0)
    assert rule.selector.matches("anything")
    (equal,) = rules_of(threshold(op="==", value="alarm")).rules
    assert isinstance(equal, ThresholdRule)
    assert equal.clear_value is None


def test_no_rules_is_valid() -> None:
    rules = compile_rules([])
    assert len(rules) == 0
    assert evaluate(rules, FiringState(), "dev-1", "ev", events("SOS")) == Evaluation()


def test_unknown_field_is_refused_by_the_decoder() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field `metricc`"):
        msgspec.toml.decode(b'[[rules]]\nkey="a"\nkind="event"\nmetricc="x"\n', type=_File)


GOOD = [event_rule("first", "SOS"), threshold("second")]


@pytest.mark.parametrize(
    ("table", "field", "fragment"),
    [
        (event_rule("bad key", "SOS"), "key", "must match"),
        (event_rule("", "SOS"), "key", "must match"),
        (event_rule("k" * 65, "SOS"), "key", "must match"),
        (
            event_rule("first", "SOS"),
            "key",
            "duplicate rule key 'first' (already used by rules[0])",
        ),
        ({**event_rule("x", "SOS"), "kind": "counter"}, "kind", "unknown kind 'counter'"),
        ({**event_rule("x", "SOS"), "severity": "major"}, "severity", "unknown severity"),
        ({**event_rule("x", "SOS"), "event": None}, "event", "required for a rule of kind"),
        (event_rule("x", "DOOR OPEN"), "event", "must match"),
        (
            event_rule("x", "SOS", metric="temp"),
            "metric",
            "does not apply to a rule of kind 'event'",
        ),
        (event_rule("x", "SOS", for_samples=2), "for_samples", "does not apply"),
        (event_rule("x", "SOS", silent_seconds=5), "silent_seconds", "does not apply"),
        (inactivity("x", event="SOS"), "event", "does not apply to a rule of kind 'inactivity'"),
        (inactivity("x", op=">"), "op", "does not apply"),
        (threshold("x", silent_seconds=5), "silent_seconds", "does not apply"),
        (threshold("x", event="SOS"), "event", "does not apply"),
        ({**threshold("x"), "metric": None}, "metric", "required"),
        (threshold("x", metric="te mp"), "metric", "must match"),
        ({**threshold("x"), "op": None}, "op", "required"),
        (threshold("x", op="=>"), "op", "unknown operator '=>'"),
        ({**threshold("x"), "value": None}, "value", "required"),
        (threshold("x", value="hot"), "value", "> compares numbers; got a str"),
        (threshold("x", op="<=", value=True), "value", "<= compares numbers; got a bool"),
        (threshold("x", value=float("nan")), "value", "must be finite"),
        (threshold("x", op="==", value=float("inf")), "value", "must be finite"),
        (threshold("x", clear_value=85), "clear_value", "must be <= value (80)"),
        (threshold("x", op=">=", clear_value=80.5), "clear_value", "must be <= value"),
        (threshold("x", op="<", value=5, clear_value=4), "clear_value", "must be >= value (5)"),
        (threshold("x", op="<=", value=5, clear_value=4.9), "clear_value", "must be >= value"),
        (threshold("x", clear_value="cool"), "clear_value", "compares numbers"),
        (threshold("x", clear_value=float("-inf")), "clear_value", "must be finite"),
        (threshold("x", op="==", value="a", clear_value="b"), "clear_value", "does not apply"),
        (threshold("x", op="!=", value=1, clear_value=1), "clear_value", "does not apply to !="),
        (threshold("x", for_samples=0), "for_samples", "integer >= 1"),
        (threshold("x", for_seconds=-1), "for_seconds", ">= 0"),
        (threshold("x", for_seconds=float("inf")), "for_seconds", ">= 0"),
        ({**inactivity("x"), "silent_seconds": None}, "silent_seconds", "required"),
        (inactivity("x", silent_seconds=0), "silent_seconds", "> 0"),
        (event_rule("x", "SOS", devices=[]), "devices", "must not be empty"),
        (event_rule("x", "SOS", devices="dev/1"), "devices", "invalid device id"),
        (event_rule("x", "SOS", devices=["dev-1", "dev 2"]), "devices[1]", "invalid device id"),
        (event_rule("x", "SOS", devices=["dev-*", "a/*"]), "devices[1]", "invalid device glob"),
    ],
)
def test_invalid_rule_names_its_key_path(table: dict[str, Any], field: str, fragment: str) -> None:
    table = {name: value for name, value in table.items() if value is not None}
    with pytest.raises(ConfigError) as caught:
        rules_of(*GOOD, table)
    assert caught.value.key_path == f"rules[2].{field}"
    assert fragment in caught.value.message


def test_python_constructed_bool_for_samples_is_refused() -> None:
    config = RuleConfig(
        key="x", kind="threshold", severity="INFO", metric="m", op=">", value=1, for_samples=True
    )
    with pytest.raises(ConfigError, match=r"rules\[0\]\.for_samples"):
        compile_rules([config])


# --- selectors and the device index ------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "matching", "not_matching"),
    [
        ("*", ["dev-1", "x", "a:b.c"], []),
        ("freezer-*", ["freezer-1", "freezer-"], ["Freezer-1", "lab-freezer-1", "freezer"]),
        ("cam-?", ["cam-1", "cam-a"], ["cam-10", "cam-"]),
        ("door-[ab]", ["door-a", "door-b"], ["door-c"]),
        ("door-[!ab]", ["door-c"], ["door-a"]),
        ("dev-1", ["dev-1"], ["dev-10", "dev-", "DEV-1"]),
        (["dev-1", "cam-*"], ["dev-1", "cam-7"], ["dev-2", "xcam-7"]),
    ],
)
def test_selector(devices: str | list[str], matching: list[str], not_matching: list[str]) -> None:
    rules = rules_of(event_rule("x", "SOS", devices=devices))
    (rule,) = rules.rules
    for device_id in matching:
        assert rule.selector.matches(device_id), device_id
        assert rules.for_device(device_id) == (rule,)
    for device_id in not_matching:
        assert not rule.selector.matches(device_id), device_id
        assert rules.for_device(device_id) == ()


def test_for_device_keeps_config_order_and_a_bounded_cache() -> None:
    built = rules_of(
        event_rule("a", "SOS", devices="lab-*"),
        event_rule("b", "SOS"),
        event_rule("c", "SOS", devices=["lab-2"]),
    )
    rules = RuleSet(built.rules, cache_size=2)
    for _ in range(3):
        assert [r.key for r in rules.for_device("lab-2")] == ["a", "b", "c"]
        assert [r.key for r in rules.for_device("lab-1")] == ["a", "b"]
        assert [r.key for r in rules.for_device("other")] == ["b"]
    assert len(rules._cache) == 2


def test_rule_set_refuses_duplicate_keys() -> None:
    rule = EventRule(key="x", severity="INFO", event="SOS")
    with pytest.raises(ValueError, match="unique"):
        RuleSet([rule, rule])


def test_selector_equality_ignores_compiled_parts() -> None:
    assert DeviceSelector(("a-*", "b")) == DeviceSelector(("a-*", "b"))


# --- event rules ---------------------------------------------------------------------------


def test_event_rule_fires_with_message_details() -> None:
    rules = rules_of(event_rule("door", "DOOR_OPEN", devices="door-*"))
    state = FiringState()
    evaluation = evaluate(rules, state, "door-1", "ev-9", events("DOOR_OPEN", at_s=2))
    assert evaluation.firings == (
        Firing("door", "MAJOR", "door-1", "ev-9", "event DOOR_OPEN", T0 + timedelta(seconds=2)),
    )
    assert evaluation.clearings == ()
    assert len(state) == 0  # evaluation alone never changes the state
    state.apply(evaluation)
    assert state.is_firing("door-1", "door")
    assert evaluate(rules, state, "lab-1", "ev-10", events("DOOR_OPEN")) == Evaluation()


def test_event_rule_fires_on_every_message_and_collapses_within_one() -> None:
    rules = rules_of(event_rule("door", "DOOR_OPEN"), event_rule("door-too", "DOOR_OPEN"))
    feed = Feed(rules)
    first = feed(events("DOOR_OPEN", "DOOR_OPEN", "SOS", "DOOR_OPEN"))
    assert kinds(first) == [("Firing", "door"), ("Firing", "door-too")]
    assert first.firings[0].reason == "event DOOR_OPEN (3 occurrences in the message)"
    assert kinds(feed(events("DOOR_OPEN"))) == [("Firing", "door"), ("Firing", "door-too")]
    assert kinds(feed(events("DOOR_CLOSE"))) == [("Clearing", "door"), ("Clearing", "door-too")]


@pytest.mark.parametrize(
    ("clear_event", "cleared"),
    [(clear, cleared) for clear, types in sorted(CLEARED_BY.items()) for cleared in sorted(types)],
)
def test_pairing_table(clear_event: str, cleared: str) -> None:
    all_types = sorted({t for types in CLEARED_BY.values() for t in types} | {"CUSTOM"})
    rules = rules_of(*(event_rule(t.lower(), t) for t in all_types))
    feed = Feed(rules)
    assert feed(events(clear_event)).outcomes == ()  # nothing firing: nothing to clear
    feed(events(*all_types))
    evaluation = feed(events(clear_event))
    expected = sorted(t.lower() for t in CLEARED_BY[clear_event])
    assert sorted(c.rule_key for c in evaluation.clearings) == expected
    assert cleared.lower() in expected
    assert evaluation.firings == ()
    reasons = {c.rule_key: c.reason for c in evaluation.clearings}
    assert reasons[cleared.lower()] == f"{clear_event} clears {cleared}"
    for t in all_types:
        assert feed.state.is_firing("dev-1", t.lower()) == (t not in CLEARED_BY[clear_event])
    assert feed(events(clear_event)).outcomes == ()  # cleared once only


def test_pairing_is_strict_by_type() -> None:
    rules = rules_of(event_rule("sos", "SOS"), event_rule("door", "DOOR_OPEN"))
    feed = Feed(rules)
    feed(events("SOS", "DOOR_OPEN"))
    assert feed(events("POWER_ON", "POWER_RESTORE", "SMOKE_CLEAR")).outcomes == ()
    assert kinds(feed(events("DOOR_CLOSE"))) == [("Clearing", "door")]
    assert feed.state.is_firing("dev-1", "sos")


def test_clearing_is_per_device() -> None:
    feed = Feed(rules_of(event_rule("door", "DOOR_OPEN")))
    feed(events("DOOR_OPEN"), "dev-1")
    assert feed(events("DOOR_CLOSE"), "dev-2").outcomes == ()
    assert kinds(feed(events("DOOR_CLOSE"), "dev-1")) == [("Clearing", "door")]


def test_outcomes_within_a_message_keep_event_order() -> None:
    feed = Feed(rules_of(event_rule("door", "DOOR_OPEN")))
    assert kinds(feed(events("DOOR_OPEN", "DOOR_CLOSE"))) == [
        ("Firing", "door"),
        ("Clearing", "door"),
    ]
    assert not feed.state.is_firing("dev-1", "door")
    feed(events("DOOR_OPEN"))
    assert kinds(feed(events("DOOR_CLOSE", "DOOR_OPEN"))) == [
        ("Clearing", "door"),
        ("Firing", "door"),
    ]
    assert feed.state.is_firing("dev-1", "door")
    # The second DOOR_OPEN would carry the same dedup key as the first: it cannot re-fire.
    feed(events("DOOR_CLOSE"))
    assert kinds(feed(events("DOOR_OPEN", "DOOR_CLOSE", "DOOR_OPEN"))) == [
        ("Firing", "door"),
        ("Clearing", "door"),
    ]
    assert not feed.state.is_firing("dev-1", "door")


def test_a_rule_on_a_clear_event_type_fires_too() -> None:
    feed = Feed(rules_of(event_rule("door", "DOOR_OPEN"), event_rule("closed", "DOOR_CLOSE")))
    feed(events("DOOR_OPEN"))
    assert kinds(feed(events("DOOR_CLOSE"))) == [("Firing", "closed"), ("Clearing", "door")]


# --- threshold rules -------------------------------------------------------------------------


def test_a_thousand_violating_samples_fire_once() -> None:
    feed = Feed(rules_of(threshold()))
    outcomes = [o for i in range(1000) for o in feed(sample(i, temp=81 + i % 5)).outcomes]
    assert len(outcomes) == 1
    (firing,) = outcomes
    assert isinstance(firing, Firing)
    assert (firing.telemetry_event_id, firing.severity, firing.reason) == (
        "ev-1",
        "CRITICAL",
        "temp 81 > 80",
    )


def test_clear_then_violate_fires_again() -> None:
    feed = Feed(rules_of(threshold(clear_value=75)))
    assert kinds(feed(sample(temp=81.2))) == [("Firing", "temp-high")]
    cleared = feed(sample(1, temp=74))
    assert kinds(cleared) == [("Clearing", "temp-high")]
    assert cleared.clearings[0].reason == "temp 74 < 75 (clear value)"
    assert cleared.clearings[0].observed_at == T0 + timedelta(seconds=1)
    assert feed(sample(2, temp=70)).outcomes == ()
    second = feed(sample(3, temp=90.5))
    assert kinds(second) == [("Firing", "temp-high")]
    assert second.firings[0].reason == "temp 90.5 > 80"


def test_hysteresis_band_does_nothing() -> None:
    feed = Feed(rules_of(threshold(clear_value=75)))
    feed(sample(temp=85))
    for value in (80, 79, 75, 77.5, 85):
        assert feed(sample(temp=value)).outcomes == (), value
    assert feed.state.is_firing("dev-1", "temp-high")
    assert kinds(feed(sample(temp=74.9))) == [("Clearing", "temp-high")]


def test_without_hysteresis_the_value_itself_is_neither_side() -> None:
    feed = Feed(rules_of(threshold()))  # temp > 80, clears below 80
    feed(sample(temp=81))
    assert feed(sample(temp=80)).outcomes == ()
    assert kinds(feed(sample(temp=79.99))) == [("Clearing", "temp-high")]
    ge = Feed(rules_of(threshold(op=">=")))
    assert kinds(ge(sample(temp=80))) == [("Firing", "temp-high")]
    assert kinds(ge(sample(temp=79))) == [("Clearing", "temp-high")]


def test_lower_bound_rule() -> None:
    feed = Feed(rules_of(threshold("cold", op="<", value=2, clear_value=4)))
    assert feed(sample(temp=2)).outcomes == ()
    assert feed.state.snapshot() == {}  # not violating: no pending either
    assert feed(sample(temp=1)).firings[0].reason == "temp 1 < 2"
    assert feed(sample(temp=4)).outcomes == ()
    assert feed(sample(temp=4.5)).clearings[0].reason == "temp 4.5 > 4 (clear value)"


def test_for_samples_needs_consecutive_violations() -> None:
    feed = Feed(rules_of(threshold(for_samples=3)))
    assert feed(sample(0, temp=81)).outcomes == ()
    assert feed(sample(1, temp=82)).outcomes == ()
    assert feed(sample(2, temp=70)).outcomes == ()  # resets
    assert feed(sample(3, temp=81)).outcomes == ()
    assert feed(sample(4, humidity=5)).outcomes == ()  # metric absent: no change
    assert feed(sample(5, temp=82)).outcomes == ()
    fired = feed(sample(6, temp=83))
    assert fired.firings[0].reason == "temp 83 > 80 for 3 samples"
    assert fired.firings[0].telemetry_event_id == "ev-7"
    assert feed(sample(7, temp=84)).outcomes == ()


def test_a_band_sample_resets_pending() -> None:
    feed = Feed(rules_of(threshold(clear_value=75, for_samples=2)))
    feed(sample(0, temp=81))
    feed(sample(1, temp=78))  # not violating (though not past the clear value either)
    assert feed(sample(2, temp=81)).outcomes == ()
    assert kinds(feed(sample(3, temp=81))) == [("Firing", "temp-high")]


def test_for_seconds_uses_device_timestamps() -> None:
    feed = Feed(rules_of(threshold(for_seconds=60)))
    assert feed(sample(100, temp=81)).outcomes == ()
    assert feed(sample(130, temp=81)).outcomes == ()
    assert feed(sample(159.9, temp=81)).outcomes == ()
    fired = feed(sample(160, temp=81))
    assert fired.firings[0].reason == "temp 81 > 80 for 4 samples over 60s"
    assert fired.firings[0].observed_at == T0 + timedelta(seconds=160)


def test_for_seconds_restarts_after_a_good_sample() -> None:
    feed = Feed(rules_of(threshold(for_seconds=60, for_samples=2)))
    feed(sample(0, temp=81))
    feed(sample(50, temp=70))
    assert feed(sample(61, temp=81)).outcomes == ()
    assert feed(sample(120, temp=81)).outcomes == ()
    assert kinds(feed(sample(121, temp=81))) == [("Firing", "temp-high")]


def test_for_samples_and_for_seconds_both_hold() -> None:
    feed = Feed(rules_of(threshold(for_seconds=10, for_samples=3)))
    feed(sample(0, temp=81))
    assert feed(sample(20, temp=81)).outcomes == ()  # long enough, too few samples
    assert kinds(feed(sample(21, temp=81))) == [("Firing", "temp-high")]


def test_equality_with_strings() -> None:
    feed = Feed(rules_of(threshold("mode", metric="mode", op="!=", value="auto")))
    assert feed(sample(mode="auto")).outcomes == ()
    fired = feed(sample(mode="manual"))
    assert fired.firings[0].reason == 'mode "manual" != "auto"'
    assert feed(sample(mode="off")).outcomes == ()
    assert feed(sample(mode="auto")).clearings[0].reason == 'mode "auto" == "auto"'
    alarm = Feed(rules_of(threshold("st", metric="state", op="==", value="alarm")))
    assert kinds(alarm(sample(state="alarm"))) == [("Firing", "st")]
    assert kinds(alarm(sample(state="ok"))) == [("Clearing", "st")]


def test_equality_keeps_bools_apart_from_numbers() -> None:
    feed = Feed(rules_of(threshold("open", metric="open", op="==", value=True)))
    assert feed(sample(open=1)).outcomes == ()
    assert feed(sample(open="true")).outcomes == ()
    fired = feed(sample(open=True))
    assert fired.firings[0].reason == "open true == true"
    assert feed(sample(open=1)).clearings[0].reason == "open 1 != true"
    numbers = Feed(rules_of(threshold("one", metric="level", op="==", value=1)))
    assert numbers(sample(level=True)).outcomes == ()
    assert kinds(numbers(sample(level=1.0))) == [("Firing", "one")]
    unlocked = Feed(rules_of(threshold("unlocked", metric="locked", op="!=", value=True)))
    assert kinds(unlocked(sample(locked=False))) == [("Firing", "unlocked")]


def test_ordering_ignores_non_numbers() -> None:
    feed = Feed(rules_of(threshold(for_samples=2)))
    feed(sample(0, temp=81))
    for value in (True, "hot"):
        assert feed(sample(temp=value)).outcomes == ()
    assert kinds(feed(sample(1, temp=81))) == [("Firing", "temp-high")]
    assert feed(sample(2, temp=False)).outcomes == ()
    assert feed.state.is_firing("dev-1", "temp-high")


def test_threshold_state_is_per_device() -> None:
    feed = Feed(rules_of(threshold(for_samples=2)))
    feed(sample(0, temp=81), "dev-1")
    assert feed(sample(0, temp=81), "dev-2").outcomes == ()
    assert feed(sample(1, temp=81), "dev-1").firings[0].device_id == "dev-1"


# --- state, staging ---------------------------------------------------------------------------


def test_rolled_back_stage_leaves_the_state_untouched() -> None:
    rules = rules_of(event_rule("door", "DOOR_OPEN"), threshold(for_samples=2))
    state = FiringState()
    state.load([("dev-1", "door")])
    before = state.snapshot()
    staged = state.stage()
    evaluate(rules, staged, "dev-1", "ev-1", events("DOOR_CLOSE"))
    evaluate(rules, staged, "dev-1", "ev-2", sample(temp=81))
    assert not staged.is_firing("dev-1", "door")
    del staged  # the transaction rolled back
    assert state.snapshot() == before
    again = evaluate(rules, state.stage(), "dev-1", "ev-1", events("DOOR_CLOSE"))
    assert kinds(again) == [("Clearing", "door")]


def test_committed_stage_applies_and_messages_see_each_other() -> None:
    rules = rules_of(event_rule("door", "DOOR_OPEN"), threshold(for_samples=2))
    state = FiringState()
    staged = state.stage()
    results = [
        evaluate(rules, staged, "dev-1", "ev-1", events("DOOR_OPEN")),
        evaluate(rules, staged, "dev-1", "ev-2", sample(0, temp=81)),
        evaluate(rules, staged, "dev-1", "ev-3", sample(1, temp=82)),
        evaluate(rules, staged, "dev-1", "ev-4", events("DOOR_CLOSE")),
        evaluate(rules, staged, "dev-1", "ev-5", sample(2, temp=83)),
    ]
    assert [kinds(r) for r in results] == [
        [("Firing", "door")],
        [],
        [("Firing", "temp-high")],
        [("Clearing", "door")],
        [],
    ]
    assert state.snapshot() == {}
    assert {(c.device_id, c.rule_key) for c in staged.changes} == {
        ("dev-1", "door"),
        ("dev-1", "temp-high"),
    }
    state.commit(staged)
    assert state.is_firing("dev-1", "temp-high")
    assert not state.is_firing("dev-1", "door")
    assert state.snapshot() == {("dev-1", "temp-high"): state.slot("dev-1", "temp-high")}


def test_commit_writes_back_only_the_slots_the_stage_changed() -> None:
    rules = rules_of(event_rule("door", "DOOR_OPEN"), inactivity())
    state = FiringState()
    staged = state.stage()
    evaluate(rules, staged, "dev-1", "ev-1", events("DOOR_OPEN"))
    state.set_firing("dev-2", "silent", True)  # the inactivity scheduler, meanwhile
    state.commit(staged)
    assert state.is_firing("dev-1", "door")
    assert state.is_firing("dev-2", "silent")


def test_stage_misuse_is_refused() -> None:
    state = FiringState()
    staged = state.stage()
    with pytest.raises(ValueError, match="not taken from this state"):
        FiringState().commit(staged)
    state.commit(staged)
    with pytest.raises(RuntimeError, match="already committed"):
        state.commit(staged)
    with pytest.raises(RuntimeError, match="already committed"):
        evaluate(rules_of(event_rule("sos", "SOS")), staged, "dev-1", "ev", events("SOS"))


def test_pending_survives_staging() -> None:
    rules = rules_of(threshold(for_samples=2))
    state = FiringState()
    first = state.stage()
    evaluate(rules, first, "dev-1", "ev-1", sample(0, temp=81))
    state.commit(first)
    second = state.stage()
    assert kinds(evaluate(rules, second, "dev-1", "ev-2", sample(1, temp=81))) == [
        ("Firing", "temp-high")
    ]
    assert isinstance(second, StagedState)


def test_load_replaces_firing_and_keeps_pending() -> None:
    rules = rules_of(threshold(for_samples=2), event_rule("door", "DOOR_OPEN"))
    feed = Feed(rules)
    feed(sample(0, temp=81), "dev-1")
    feed(events("DOOR_OPEN"), "dev-2")
    feed.state.load([("dev-3", "door"), ("dev-4", "temp-high")])
    assert not feed.state.is_firing("dev-2", "door")
    assert feed.state.is_firing("dev-3", "door")
    assert feed(sample(1, temp=81), "dev-4").outcomes == ()  # firing per the database
    assert kinds(feed(sample(1, temp=81), "dev-1")) == [("Firing", "temp-high")]


def test_set_firing_corrects_one_slot() -> None:
    feed = Feed(rules_of(threshold()))
    feed(sample(temp=81))
    feed.state.set_firing("dev-1", "temp-high", False)  # a person closed the alarm
    assert kinds(feed(sample(temp=81))) == [("Firing", "temp-high")]


# --- inactivity rules ------------------------------------------------------------------------


def test_next_message_clears_firing_inactivity() -> None:
    rules = rules_of(inactivity(), inactivity("quiet-cams", devices="cam-*"))
    feed = Feed(rules)
    assert feed(sample(temp=1), "cam-1").outcomes == ()
    feed.state.load([("cam-1", "silent"), ("cam-1", "quiet-cams"), ("dev-1", "silent")])
    evaluation = feed(events("ANYTHING", at_s=5), "cam-1")
    assert kinds(evaluation) == [("Clearing", "silent"), ("Clearing", "quiet-cams")]
    assert evaluation.clearings[0] == Clearing(
        "silent", "cam-1", "ev-2", "the device sent a message again", T0 + timedelta(seconds=5)
    )
    assert feed(sample(temp=1), "cam-1").outcomes == ()
    assert feed.state.is_firing("dev-1", "silent")


def test_inactivity_firing() -> None:
    (rule,) = rules_of(inactivity(devices="cam-*")).rules
    assert isinstance(rule, InactivityRule)
    last_seen = T0
    assert not inactivity_firing(rule, "cam-1", last_seen, T0 + timedelta(seconds=299.999))
    assert inactivity_firing(rule, "cam-1", last_seen, T0 + timedelta(seconds=300))
    assert not inactivity_firing(rule, "dev-1", last_seen, T0 + timedelta(days=1))


# --- laws ----------------------------------------------------------------------------------

LAW_RULES = rules_of(
    threshold("hot", op=">", value=50, clear_value=40, for_samples=2, for_seconds=3),
    threshold("cold", op="<=", value=10, for_samples=1),
    threshold("mode", metric="mode", op="!=", value="auto"),
    event_rule("door", "DOOR_OPEN"),
    event_rule("power", "POWER_CUT"),
    inactivity(),
)
EVENT_TYPES = ["DOOR_OPEN", "DOOR_CLOSE", "POWER_CUT", "POWER_ON", "POWER_RESTORE", "SOS"]

messages_strategy = st.lists(
    st.tuples(
        st.sampled_from(["dev-1", "dev-2"]),
        st.integers(min_value=0, max_value=5),  # seconds since the device's previous message
        st.one_of(
            st.builds(
                lambda temp, mode: {"temp": temp, "mode": mode},
                st.one_of(st.integers(0, 60), st.floats(0, 60), st.booleans()),
                st.sampled_from(["auto", "manual"]),
            ),
            st.lists(st.sampled_from(EVENT_TYPES), min_size=1, max_size=4),
        ),
        st.booleans(),  # the inactivity scheduler fires for this device first
    ),
    max_size=60,
)


def _messages(
    drawn: list[tuple[str, int, dict[str, Any] | list[str], bool]],
) -> list[tuple[str, Telemetry, bool]]:
    clock: dict[str, int] = {}
    result = []
    for device_id, gap_s, body, silent in drawn:
        clock[device_id] = clock.get(device_id, 0) + gap_s
        message = sample(clock[device_id], **body) if isinstance(body, dict) else events(*body)
        result.append((device_id, message, silent))
    return result


@settings(max_examples=200, deadline=None)
@given(messages_strategy)
def test_firings_and_clearings_alternate(
    drawn: list[tuple[str, int, dict[str, Any] | list[str], bool]],
) -> None:
    """Per (device, rule): a clearing only follows a firing; the state mirrors the last one.

    Only event rules may fire twice in a row (each new occurrence; the database supersedes).
    """
    feed = Feed(LAW_RULES)
    last: dict[tuple[str, str], str] = {}
    for device_id, message, silent in _messages(drawn):
        if silent:
            feed.state.set_firing(device_id, "silent", True)
            last[(device_id, "silent")] = "Firing"
        for outcome in feed(message, device_id).outcomes:
            key = (device_id, outcome.rule_key)
            kind = type(outcome).__name__
            if kind == "Clearing":
                assert last.get(key) == "Firing", key
            elif outcome.rule_key not in ("door", "power"):
                assert last.get(key) in (None, "Clearing"), key
            last[key] = kind
        for (device, rule_key), kind in last.items():
            assert feed.state.is_firing(device, rule_key) == (kind == "Firing")


@settings(max_examples=100, deadline=None)
@given(messages_strategy, st.integers(min_value=1, max_value=60))
def test_staged_batches_match_one_by_one(
    drawn: list[tuple[str, int, dict[str, Any] | list[str], bool]], batch_size: int
) -> None:
    messages = [(d, m) for d, m, _ in _messages(drawn)]
    one_by_one = Feed(LAW_RULES)
    expected = [one_by_one(message, device_id) for device_id, message in messages]

    state = FiringState()
    got: list[Evaluation] = []
    for start in range(0, len(messages), batch_size):
        staged = state.stage()
        for offset, (device_id, message) in enumerate(messages[start : start + batch_size]):
            event_id = f"ev-{start + offset + 1}"
            got.append(evaluate(LAW_RULES, staged, device_id, event_id, message))
        state.commit(staged)
    assert [e.outcomes for e in got] == [e.outcomes for e in expected]
    assert state.snapshot() == one_by_one.state.snapshot()
