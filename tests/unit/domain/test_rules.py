from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.domain.alarm import CLEAR_PAIRS
from gateway.domain.errors import ConfigError
from gateway.domain.rules import (
    IDLE,
    Clearing,
    DeviceSelector,
    Evaluation,
    EventRule,
    Firing,
    InactivityRule,
    RuleConfig,
    RuleSet,
    RuleState,
    RuleStates,
    ThresholdRule,
    compile_rules,
    evaluate,
    inactivity_firing,
    rule_version,
    silence_trigger,
    state_keys,
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
    """Evaluates messages one at a time against one table of states, as the database holds
    them between batches (only the keys `state_keys` names are handed to `evaluate`)."""

    def __init__(self, rules: RuleSet, states: RuleStates | None = None) -> None:
        self.rules = rules
        self.states: RuleStates = {} if states is None else states
        self.count = 0

    def __call__(
        self, message: Telemetry, device_id: str = "dev-1", event_id: str | None = None
    ) -> Evaluation:
        self.count += 1
        keys = state_keys(self.rules, device_id, message)
        batch = {key: self.states[key] for key in keys if key in self.states}
        evaluation = evaluate(self.rules, batch, device_id, event_id or f"ev-{self.count}", message)
        assert set(batch) <= keys, "evaluate touched a state state_keys did not name"
        self.states.update(batch)
        return evaluation

    def state(self, device_id: str, rule_key: str) -> RuleState:
        return self.states.get((device_id, rule_key), IDLE)

    def is_firing(self, device_id: str, rule_key: str) -> bool:
        return self.state(device_id, rule_key).firing


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
    assert evaluate(rules, {}, "dev-1", "ev", events("SOS")) == Evaluation()


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
        (threshold("x", metric="te#mp"), "metric", "must match"),
        (threshold("x", metric="te\tmp"), "metric", "must match"),
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
        (event_rule("x", "SOS", devices="dev/1/2/3"), "devices", "invalid device id"),
        (event_rule("x", "SOS", devices="dev//1"), "devices", "invalid device id"),
        (event_rule("x", "SOS", devices=["dev-1", "dev 2"]), "devices[1]", "invalid device id"),
        (event_rule("x", "SOS", devices=["dev-*", "a /*"]), "devices[1]", "invalid device glob"),
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


def test_devices_the_same_rules_apply_to_share_one_index_and_the_shared_ones_are_bounded() -> None:
    built = rules_of(
        event_rule("a", "SOS", devices="lab-*"),
        event_rule("b", "SOS"),
        threshold("t", devices=["lab-2"]),
    )
    rules = RuleSet(built.rules, cache_size=100)
    labs = [rules._device(f"lab-{n}") for n in (1, 3, 4)]
    assert all(index is labs[0] for index in labs), "one index for every lab but lab-2"
    lab2 = rules._device("lab-2")
    assert lab2 is not labs[0]
    assert [r.key for r in lab2.thresholds] == ["t"]
    assert labs[0].thresholds == ()
    assert rules._device("other") is rules._device("elsewhere")
    assert len(rules._shared) == 3

    small = RuleSet(built.rules, cache_size=2)
    for device in ("lab-1", "lab-2", "other", "lab-2", "lab-1"):
        small._device(device)
        assert len(small._shared) <= 2
    assert [r.key for r in small.for_device("lab-2")] == ["a", "b", "t"]


def test_rule_set_refuses_duplicate_keys() -> None:
    rule = EventRule(key="x", severity="INFO", event="SOS")
    with pytest.raises(ValueError, match="unique"):
        RuleSet([rule, rule])


def test_selector_equality_ignores_compiled_parts() -> None:
    assert DeviceSelector(("a-*", "b")) == DeviceSelector(("a-*", "b"))


# --- event rules ---------------------------------------------------------------------------


def test_event_rule_fires_with_message_details() -> None:
    rules = rules_of(event_rule("door", "DOOR_OPEN", devices="door-*"))
    states: RuleStates = {}
    evaluation = evaluate(rules, states, "door-1", "ev-9", events("DOOR_OPEN", at_s=2))
    assert evaluation.firings == (
        Firing("door", "MAJOR", "door-1", "ev-9", "event DOOR_OPEN", T0 + timedelta(seconds=2)),
    )
    assert evaluation.clearings == ()
    assert states[("door-1", "door")].firing
    assert states[("door-1", "door")].fired_event_id == "ev-9"
    assert evaluate(rules, states, "lab-1", "ev-10", events("DOOR_OPEN")) == Evaluation()


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
    [(clear, cleared) for clear, types in sorted(CLEAR_PAIRS.items()) for cleared in sorted(types)],
)
def test_pairing_table(clear_event: str, cleared: str) -> None:
    all_types = sorted({t for types in CLEAR_PAIRS.values() for t in types} | {"CUSTOM"})
    rules = rules_of(*(event_rule(t.lower(), t) for t in all_types))
    feed = Feed(rules)
    assert feed(events(clear_event)).outcomes == ()  # nothing firing: nothing to clear
    feed(events(*all_types))
    evaluation = feed(events(clear_event))
    expected = sorted(t.lower() for t in CLEAR_PAIRS[clear_event])
    assert sorted(c.rule_key for c in evaluation.clearings) == expected
    assert cleared.lower() in expected
    assert evaluation.firings == ()
    reasons = {c.rule_key: c.reason for c in evaluation.clearings}
    assert reasons[cleared.lower()] == f"{clear_event} clears {cleared}"
    for t in all_types:
        assert feed.is_firing("dev-1", t.lower()) == (t not in CLEAR_PAIRS[clear_event])
    assert feed(events(clear_event)).outcomes == ()  # cleared once only


def test_pairing_is_strict_by_type() -> None:
    rules = rules_of(event_rule("sos", "SOS"), event_rule("door", "DOOR_OPEN"))
    feed = Feed(rules)
    feed(events("SOS", "DOOR_OPEN"))
    assert feed(events("POWER_ON", "POWER_RESTORE", "SMOKE_CLEAR")).outcomes == ()
    assert kinds(feed(events("DOOR_CLOSE"))) == [("Clearing", "door")]
    assert feed.is_firing("dev-1", "sos")


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
    assert not feed.is_firing("dev-1", "door")
    feed(events("DOOR_OPEN"))
    assert kinds(feed(events("DOOR_CLOSE", "DOOR_OPEN"))) == [
        ("Clearing", "door"),
        ("Firing", "door"),
    ]
    assert feed.is_firing("dev-1", "door")
    # The second DOOR_OPEN would carry the same dedup key as the first: it cannot re-fire.
    feed(events("DOOR_CLOSE"))
    assert kinds(feed(events("DOOR_OPEN", "DOOR_CLOSE", "DOOR_OPEN"))) == [
        ("Firing", "door"),
        ("Clearing", "door"),
    ]
    assert not feed.is_firing("dev-1", "door")


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
    assert feed.is_firing("dev-1", "temp-high")
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
    assert feed.state("dev-1", "cold").pending_count == 0  # not violating: no pending either
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
    assert feed.is_firing("dev-1", "temp-high")


def test_threshold_state_is_per_device() -> None:
    feed = Feed(rules_of(threshold(for_samples=2)))
    feed(sample(0, temp=81), "dev-1")
    assert feed(sample(0, temp=81), "dev-2").outcomes == ()
    assert feed(sample(1, temp=81), "dev-1").firings[0].device_id == "dev-1"


# --- state ----------------------------------------------------------------------------------


def test_state_keys_name_exactly_what_a_message_touches() -> None:
    rules = rules_of(
        event_rule("door", "DOOR_OPEN"), event_rule("sos", "SOS", devices="wrist-*"),
        threshold(), threshold("wet", metric="humidity", value=90), inactivity(),
    )  # fmt: skip
    assert state_keys(rules, "dev-1", sample(temp=1)) == {("dev-1", "temp-high")}
    assert state_keys(rules, "dev-1", events("DOOR_CLOSE", "SOS")) == {("dev-1", "door")}
    assert state_keys(rules, "wrist-1", events("SOS_CLEAR")) == {("wrist-1", "sos")}
    both = Telemetry(ts=T0_MS, metrics={"temp": 1, "humidity": 2}, events=[{"type": "DOOR_OPEN"}])
    assert state_keys(rules, "dev-1", both) == {
        ("dev-1", "door"), ("dev-1", "temp-high"), ("dev-1", "wet"),
    }  # fmt: skip
    assert state_keys(rules_of(), "dev-1", both) == set()


def test_messages_of_one_batch_see_each_other() -> None:
    rules = rules_of(event_rule("door", "DOOR_OPEN"), threshold(for_samples=2))
    states: RuleStates = {}
    results = [
        evaluate(rules, states, "dev-1", "ev-1", events("DOOR_OPEN")),
        evaluate(rules, states, "dev-1", "ev-2", sample(0, temp=81)),
        evaluate(rules, states, "dev-1", "ev-3", sample(1, temp=82)),
        evaluate(rules, states, "dev-1", "ev-4", events("DOOR_CLOSE")),
        evaluate(rules, states, "dev-1", "ev-5", sample(2, temp=83)),
    ]
    assert [kinds(r) for r in results] == [
        [("Firing", "door")], [], [("Firing", "temp-high")], [("Clearing", "door")], [],
    ]  # fmt: skip
    assert states[("dev-1", "temp-high")].firing
    assert not states[("dev-1", "door")].firing


def test_pending_counts_live_in_the_state() -> None:
    rules = rules_of(threshold(for_samples=2, for_seconds=5))
    states: RuleStates = {}
    evaluate(rules, states, "dev-1", "ev-1", sample(0, temp=81))
    assert states[("dev-1", "temp-high")] == RuleState(
        pending_count=1, pending_since=T0, last_ts=T0, violating_ts=T0
    )
    fresh = dict(states)  # what another node reads from the database
    assert kinds(evaluate(rules, fresh, "dev-1", "ev-2", sample(5, temp=81))) == [
        ("Firing", "temp-high")
    ]
    assert fresh[("dev-1", "temp-high")].pending_count == 0


def test_a_rearmed_state_keeps_its_facts_and_drops_pending() -> None:
    state = RuleState(pending_count=2, pending_since=T0, last_ts=T0, clear_ts=T0,
                      clear_event_id="ev-1")  # fmt: skip
    assert state.rearmed() == RuleState(last_ts=T0, clear_ts=T0, clear_event_id="ev-1")


def test_rule_version_changes_with_what_the_state_depends_on() -> None:
    (base,) = rules_of(threshold()).rules
    (texts,) = rules_of(threshold(severity="INFO", description="x", devices="a-*")).rules
    (other,) = rules_of(threshold(value=90)).rules
    (slower,) = rules_of(threshold(for_samples=3)).rules
    assert rule_version(base) == rule_version(texts)
    assert len({rule_version(base), rule_version(other), rule_version(slower)}) == 3
    (door,) = rules_of(event_rule("door", "DOOR_OPEN")).rules
    (sos,) = rules_of(event_rule("door", "SOS")).rules
    assert rule_version(door) != rule_version(sos)


def test_a_firing_state_from_an_upgrade_clears_on_any_clear() -> None:
    feed = Feed(rules_of(event_rule("door", "DOOR_OPEN"), threshold()))
    feed.states[("dev-1", "door")] = RuleState(firing=True)  # seeded from an active alarm
    feed.states[("dev-1", "temp-high")] = RuleState(firing=True)
    assert kinds(feed(events("DOOR_CLOSE", at_s=-100))) == [("Clearing", "door")]
    assert feed(sample(-50, temp=90)).outcomes == ()
    assert kinds(feed(sample(-40, temp=70))) == [("Clearing", "temp-high")]


# --- the ordering rule: samples committed out of order ---------------------------------------


def test_a_late_threshold_sample_never_moves_the_state_back() -> None:
    feed = Feed(rules_of(threshold(clear_value=75)))
    assert kinds(feed(sample(9, temp=95))) == [("Firing", "temp-high")]
    assert kinds(feed(sample(11, temp=70))) == [("Clearing", "temp-high")]
    # Sample 10 = 95 was held by another node: in device order it changed nothing (the rule
    # was firing at its time), and committed late it must not re-fire.
    assert feed(sample(10, temp=95)).outcomes == ()
    assert not feed.is_firing("dev-1", "temp-high")
    assert feed.state("dev-1", "temp-high").last_ts == T0 + timedelta(seconds=11)
    # And a late clearing sample does not clear a newer firing: only the alarm of its time.
    assert kinds(feed(sample(20, temp=95))) == [("Firing", "temp-high")]
    (clearing,) = feed(sample(19, temp=60)).outcomes
    assert isinstance(clearing, Clearing)
    assert clearing.raised_by_then == T0 + timedelta(seconds=19)
    assert feed.is_firing("dev-1", "temp-high")


def test_equal_timestamps_are_ordered_by_seq_when_both_have_one() -> None:
    feed = Feed(rules_of(threshold(clear_value=75)))
    at = T0_MS + 5000
    assert kinds(feed(Telemetry(ts=at, seq=2, metrics={"temp": 95}))) == [("Firing", "temp-high")]
    assert feed(Telemetry(ts=at, seq=1, metrics={"temp": 70})).outcomes == ()  # late
    assert kinds(feed(Telemetry(ts=at, seq=3, metrics={"temp": 70}))) == [("Clearing", "temp-high")]
    assert kinds(feed(Telemetry(ts=at, metrics={"temp": 95}))) == [("Firing", "temp-high")]


def test_a_late_spike_raises_its_alarm_already_cleared() -> None:
    feed = Feed(rules_of(threshold(clear_value=75)))
    feed(sample(10, temp=70), event_id="ev-10")
    feed(sample(12, temp=70), event_id="ev-12")
    # The only violating sample, 11 = 95, committed after 12 = 70: one node in device order
    # raised an alarm at 11 and cleared it at 12. So here.
    late = feed(sample(11, temp=95), event_id="ev-11")
    assert kinds(late) == [("Firing", "temp-high"), ("Clearing", "temp-high")]
    assert late.firings[0].telemetry_event_id == "ev-11"
    assert late.firings[0].superseded_by_event is None
    assert late.clearings[0].telemetry_event_id == "ev-12"
    assert late.clearings[0].observed_at == T0 + timedelta(seconds=12)
    assert not feed.is_firing("dev-1", "temp-high")
    assert feed(sample(11.5, temp=96)).outcomes == ()  # inside that alarm's span now


def test_a_late_spike_after_a_band_sample_leaves_the_rule_firing() -> None:
    feed = Feed(rules_of(threshold(clear_value=75)))
    feed(sample(12, temp=78))  # in the band: would have kept an alarm of 11 going
    assert kinds(feed(sample(11, temp=95))) == [("Firing", "temp-high")]
    assert feed.is_firing("dev-1", "temp-high")
    assert kinds(feed(sample(13, temp=70))) == [("Clearing", "temp-high")]


def test_a_late_spike_older_than_a_newer_alarm_adds_nothing() -> None:
    feed = Feed(rules_of(threshold(clear_value=75)))
    feed(sample(10, temp=70))
    feed(sample(12, temp=95))
    feed(sample(13, temp=70))
    assert feed(sample(11, temp=95)).outcomes == ()  # the alarm of 12 stands for it


def test_a_late_violation_inside_the_pending_run_counts() -> None:
    feed = Feed(rules_of(threshold(for_samples=3)))
    feed(sample(1, temp=81))
    feed(sample(3, temp=81))
    fired = feed(sample(2, temp=81))  # late, but inside the run of 1..3
    assert kinds(fired) == [("Firing", "temp-high")]
    assert feed.state("dev-1", "temp-high").fired_ts == T0 + timedelta(seconds=3)
    before = Feed(rules_of(threshold(for_samples=3)))
    before(sample(5, temp=81))
    before(sample(6, temp=81))
    assert before(sample(4, temp=81)).outcomes == ()  # before the run: its run is unknown
    assert before.state("dev-1", "temp-high").pending_count == 2


def test_an_event_committed_after_its_clear_is_an_alarm_already_cleared() -> None:
    feed = Feed(rules_of(event_rule("door", "DOOR_OPEN")))
    assert feed(events("DOOR_CLOSE", at_s=11), event_id="close-11").outcomes == ()
    late = feed(events("DOOR_OPEN", at_s=10), event_id="open-10")
    assert kinds(late) == [("Firing", "door"), ("Clearing", "door")]
    assert late.clearings[0].telemetry_event_id == "close-11"
    assert not feed.is_firing("dev-1", "door")
    assert kinds(feed(events("DOOR_OPEN", at_s=12))) == [("Firing", "door")]


def test_an_event_older_than_the_alarm_raised_since_is_created_superseded() -> None:
    feed = Feed(rules_of(event_rule("door", "DOOR_OPEN")))
    feed(events("DOOR_OPEN", at_s=12), event_id="open-12")
    late = feed(events("DOOR_OPEN", at_s=10), event_id="open-10")
    (firing,) = late.outcomes
    assert isinstance(firing, Firing)
    assert (firing.superseded_by_event, firing.cleared_by_event) == ("open-12", None)
    assert feed.is_firing("dev-1", "door")
    assert feed.state("dev-1", "door").fired_event_id == "open-12"
    # With a clear in between: superseded and cleared by it.
    feed(events("DOOR_CLOSE", at_s=13), event_id="close-13")
    feed(events("DOOR_OPEN", at_s=20), event_id="open-20")
    (between,) = feed(events("DOOR_OPEN", at_s=12.5), event_id="open-12.5").outcomes
    assert isinstance(between, Firing)
    assert (between.superseded_by_event, between.cleared_by_event) == ("open-20", "close-13")
    # A late clear older than the firing alarm clears the alarm of its time, not this one.
    (clearing,) = feed(events("DOOR_CLOSE", at_s=15)).outcomes
    assert isinstance(clearing, Clearing)
    assert clearing.raised_by_then == T0 + timedelta(seconds=15)
    assert feed.is_firing("dev-1", "door")


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
    ),
    max_size=60,
)


def _messages(
    drawn: list[tuple[str, int, dict[str, Any] | list[str]]],
) -> list[tuple[str, Telemetry]]:
    clock: dict[str, int] = {}
    result = []
    for device_id, gap_s, body in drawn:
        clock[device_id] = clock.get(device_id, 0) + gap_s
        message = sample(clock[device_id], **body) if isinstance(body, dict) else events(*body)
        result.append((device_id, message))
    return result


@settings(max_examples=200, deadline=None)
@given(messages_strategy)
def test_firings_and_clearings_alternate(
    drawn: list[tuple[str, int, dict[str, Any] | list[str]]],
) -> None:
    """Per (device, rule), in device order: a clearing only follows a firing; the state
    mirrors the last one. Only event rules may fire twice in a row (each new occurrence; the
    database supersedes)."""
    feed = Feed(LAW_RULES)
    last: dict[tuple[str, str], str] = {}
    for device_id, message in _messages(drawn):
        for outcome in feed(message, device_id).outcomes:
            key = (device_id, outcome.rule_key)
            kind = type(outcome).__name__
            if kind == "Clearing":
                assert last.get(key) == "Firing", key
            elif outcome.rule_key not in ("door", "power"):
                assert last.get(key) in (None, "Clearing"), key
            last[key] = kind
        for (device, rule_key), kind in last.items():
            assert feed.is_firing(device, rule_key) == (kind == "Firing")


ORDER_RULES = rules_of(
    threshold("hot", op=">", value=50, clear_value=40),
    event_rule("door", "DOOR_OPEN"),
)


@st.composite
def _two_nodes(draw: st.DrawFn) -> tuple[list[Telemetry], list[int]]:
    """One device's messages at strictly increasing times, and an order of committing them
    that two nodes taking turns could produce (any permutation)."""
    bodies = draw(
        st.lists(
            st.one_of(
                st.sampled_from([{"temp": 30}, {"temp": 45}, {"temp": 60}]),
                st.sampled_from([["DOOR_OPEN"], ["DOOR_CLOSE"]]),
            ),
            min_size=1,
            max_size=12,
        )
    )
    messages = [
        sample(i, **body) if isinstance(body, dict) else events(*body, at_s=i)
        for i, body in enumerate(bodies)
    ]
    order = draw(st.permutations(range(len(messages))))
    return messages, list(order)


@settings(max_examples=300, deadline=None)
@given(_two_nodes())
def test_any_commit_order_ends_where_device_order_ends(
    drawn: tuple[list[Telemetry], list[int]],
) -> None:
    """Whatever order the samples commit in: every door opening raises exactly one alarm
    (never dropped), and the rules end firing exactly as in device order."""
    messages, order = drawn
    in_order = Feed(ORDER_RULES)
    for index, message in enumerate(messages):
        in_order(message, event_id=f"ev-{index}")
    shuffled = Feed(ORDER_RULES)
    door_firings: dict[str, int] = {}
    for index in order:
        for firing in shuffled(messages[index], event_id=f"ev-{index}").firings:
            if firing.rule_key == "door":
                door_firings[firing.telemetry_event_id] = (
                    door_firings.get(firing.telemetry_event_id, 0) + 1
                )
    openings = {
        f"ev-{i}" for i, m in enumerate(messages) if m.events and "DOOR_OPEN" in m.event_types()
    }
    assert door_firings == dict.fromkeys(openings, 1)
    for rule_key in ("hot", "door"):
        assert shuffled.is_firing("dev-1", rule_key) == in_order.is_firing("dev-1", rule_key)


# --- why a rule fired -----------------------------------------------------------------------


def test_a_firing_says_why_and_carries_the_rule_description() -> None:
    feed = Feed(
        rules_of(
            threshold(clear_value=75, description="The oven runs hot."),
            event_rule("door", "DOOR_OPEN"),
        )
    )
    (hot,) = feed(sample(temp=81.5)).firings
    assert hot.trigger == {
        "metric": "temp", "op": ">", "threshold": 80, "value": 81.5,
        "sample_ts": T0.isoformat(),
    }  # fmt: skip
    assert hot.rule_description == "The oven runs hot."
    (door,) = feed(events("DOOR_OPEN", at_s=3)).firings
    assert door.trigger == {
        "event": "DOOR_OPEN",
        "sample_ts": (T0 + timedelta(seconds=3)).isoformat(),
    }
    assert door.rule_description == ""
    assert silence_trigger(T0) == {"silent_since": T0.isoformat()}
