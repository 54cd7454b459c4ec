"""The `[[rules]]` tables as operators write them (`RuleConfig`) and their validation into
rules (`compile_rules`): errors name the key path (`rules[2].clear_value`)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final, TypeVar

import msgspec

from gateway.domain.alarm import Severity
from gateway.domain.errors import ConfigError
from gateway.domain.rules.model import (
    OPS,
    RULE_KINDS,
    SEVERITIES,
    DeviceSelector,
    EventRule,
    InactivityRule,
    Op,
    Rule,
    RuleKind,
    RuleSet,
    ThresholdRule,
    _is_glob,
    _is_number,
)
from protocol import MetricValue, is_valid_device_id, sparkplug
from protocol.ids import IDENTIFIER_PATTERN

__all__ = [
    "RULE_KEY_PATTERN",
    "RuleConfig",
    "compile_rule",
    "compile_rules",
    "device_selector",
]


_T = TypeVar("_T")

RULE_KEY_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,64}\Z"

_RULE_KEY_RE: Final = re.compile(RULE_KEY_PATTERN)
_IDENTIFIER_RE: Final = re.compile(IDENTIFIER_PATTERN)
# `/` separates the levels of a Sparkplug id (`{group}/{node}/{device}`, docs/sparkplug.md).
_GLOB_RE: Final = re.compile(r"^[A-Za-z0-9_.:/\-*?\[\]!]{1,200}\Z")
# A metric name: a native one, or a Sparkplug one with its folders and spaces ("Inputs/temp").
METRIC_NAME_PATTERN: Final = r"^[A-Za-z0-9_.:/ -]{1,256}\Z"
_METRIC_NAME_RE: Final = re.compile(METRIC_NAME_PATTERN)
_SEVERITY_BY_NAME: Final[Mapping[str, Severity]] = {s.value: s for s in Severity}
_KIND_BY_NAME: Final[Mapping[str, RuleKind]] = {name: name for name in RULE_KINDS}
_OP_BY_NAME: Final[Mapping[str, Op]] = {name: name for name in OPS}
# Fields that belong to one kind only; any other kind refuses them.
_KIND_FIELDS: Final[Mapping[RuleKind, frozenset[str]]] = {
    "event": frozenset({"event"}),
    "threshold": frozenset({"metric", "op", "value", "clear_value", "for_samples", "for_seconds"}),
    "inactivity": frozenset({"silent_seconds"}),
}
_ALL_KIND_FIELDS: Final = tuple(sorted(frozenset().union(*_KIND_FIELDS.values())))


class RuleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One `[[rules]]` table as written by operators; `compile_rules` validates it.

    `kind`, `severity` and `op` are plain strings so that `compile_rules` reports every
    mistake the same way; kind-specific fields are `None` when absent so that a field given
    to the wrong kind is an error rather than silently ignored.
    """

    key: str
    kind: str
    severity: str
    devices: str | list[str] = "*"
    description: str = ""
    event: str | None = None
    metric: str | None = None
    op: str | None = None
    value: MetricValue | None = None
    clear_value: MetricValue | None = None
    for_samples: int | None = None
    for_seconds: float | None = None
    silent_seconds: float | None = None


def compile_rules(configs: Sequence[RuleConfig]) -> RuleSet:
    """Validate the `[[rules]]` tables; errors name the key path (`rules[2].clear_value`)."""
    first_index: dict[str, int] = {}
    rules: list[Rule] = []
    for index, config in enumerate(configs):
        path = f"rules[{index}]"
        rule = compile_rule(config, path)
        if rule.key in first_index:
            raise ConfigError(
                f"{path}.key",
                f"duplicate rule key {rule.key!r} (already used by rules[{first_index[rule.key]}])",
            )
        first_index[rule.key] = index
        rules.append(rule)
    return RuleSet(rules)


def compile_rule(config: RuleConfig, path: str = "rule") -> Rule:
    def at(name: str) -> str:
        return f"{path}.{name}"

    if _RULE_KEY_RE.fullmatch(config.key) is None:
        raise ConfigError(at("key"), f"must match {RULE_KEY_PATTERN}")
    kind = _KIND_BY_NAME.get(config.kind)
    if kind is None:
        raise ConfigError(
            at("kind"), f"unknown kind {config.kind!r}; expected {_one_of(RULE_KINDS)}"
        )
    severity = _SEVERITY_BY_NAME.get(config.severity)
    if severity is None:
        raise ConfigError(
            at("severity"), f"unknown severity {config.severity!r}; expected {_one_of(SEVERITIES)}"
        )
    for name in _ALL_KIND_FIELDS:
        if name not in _KIND_FIELDS[kind] and getattr(config, name) is not None:
            raise ConfigError(at(name), f"does not apply to a rule of kind {kind!r}")
    selector = device_selector(config.devices, at("devices"))
    match kind:
        case "event":
            return EventRule(
                key=config.key,
                severity=severity,
                selector=selector,
                description=config.description,
                event=_identifier(config.event, at("event"), kind),
            )
        case "threshold":
            return _threshold_rule(config, severity, selector, at)
        case "inactivity":
            silent = _required(config.silent_seconds, at("silent_seconds"), kind)
            if not (math.isfinite(silent) and silent > 0):
                raise ConfigError(at("silent_seconds"), "must be a number of seconds > 0")
            return InactivityRule(
                key=config.key,
                severity=severity,
                selector=selector,
                description=config.description,
                silent_seconds=silent,
            )


def _threshold_rule(
    config: RuleConfig,
    severity: Severity,
    selector: DeviceSelector,
    at: Callable[[str], str],
) -> ThresholdRule:
    metric = _metric_name(config.metric, at("metric"))
    op_name = _required(config.op, at("op"), "threshold")
    op = _OP_BY_NAME.get(op_name)
    if op is None:
        raise ConfigError(at("op"), f"unknown operator {op_name!r}; expected {_one_of(OPS)}")
    value = config.value
    if value is None:
        raise ConfigError(at("value"), "required for a rule of kind 'threshold'")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(at("value"), "must be finite")
    clear_value = _clear_value(config, op, value, at)
    for_samples = 1 if config.for_samples is None else config.for_samples
    if type(for_samples) is not int or for_samples < 1:
        raise ConfigError(at("for_samples"), "must be an integer >= 1")
    for_seconds = 0.0 if config.for_seconds is None else float(config.for_seconds)
    if not (math.isfinite(for_seconds) and for_seconds >= 0):
        raise ConfigError(at("for_seconds"), "must be a number of seconds >= 0")
    return ThresholdRule(
        key=config.key,
        severity=severity,
        selector=selector,
        description=config.description,
        metric=metric,
        op=op,
        value=value,
        clear_value=clear_value,
        for_samples=for_samples,
        for_seconds=for_seconds,
    )


def _clear_value(
    config: RuleConfig, op: Op, value: MetricValue, at: Callable[[str], str]
) -> int | float | None:
    if op in ("==", "!="):
        if config.clear_value is not None:
            raise ConfigError(
                at("clear_value"),
                f"does not apply to {op}: the rule clears as soon as the comparison is false",
            )
        return None
    if not _is_number(value):
        raise ConfigError(at("value"), f"{op} compares numbers; got {_type_name(value)}")
    clear = value if config.clear_value is None else config.clear_value
    if not _is_number(clear):
        raise ConfigError(at("clear_value"), f"{op} compares numbers; got {_type_name(clear)}")
    if isinstance(clear, float) and not math.isfinite(clear):
        raise ConfigError(at("clear_value"), "must be finite")
    if op in (">", ">=") and clear > value:
        raise ConfigError(
            at("clear_value"),
            f"must be <= value ({value}) for {op}: the rule re-arms below clear_value",
        )
    if op in ("<", "<=") and clear < value:
        raise ConfigError(
            at("clear_value"),
            f"must be >= value ({value}) for {op}: the rule re-arms above clear_value",
        )
    return clear


def device_selector(devices: str | Sequence[str], path: str) -> DeviceSelector:
    if isinstance(devices, str):
        _check_device_pattern(devices, path)
        return DeviceSelector((devices,))
    if not devices:
        raise ConfigError(path, 'must not be empty (use "*" for every device)')
    for index, pattern in enumerate(devices):
        _check_device_pattern(pattern, f"{path}[{index}]")
    return DeviceSelector(tuple(devices))


def _check_device_pattern(pattern: str, path: str) -> None:
    if _is_glob(pattern):
        if _GLOB_RE.fullmatch(pattern) is None:
            raise ConfigError(path, f"invalid device glob {pattern!r}")
    elif not is_valid_device_id(pattern) and not sparkplug.is_device_key(pattern):
        raise ConfigError(
            path,
            f"invalid device id {pattern!r}: must match {IDENTIFIER_PATTERN}, or be a "
            "Sparkplug id {group}/{node}[/{device}] whose levels do",
        )


def _metric_name(value: str | None, path: str) -> str:
    name = _required(value, path, "threshold")
    if _METRIC_NAME_RE.fullmatch(name) is None:
        raise ConfigError(path, f"must match {METRIC_NAME_PATTERN}")
    return name


def _identifier(value: str | None, path: str, kind: RuleKind) -> str:
    name = _required(value, path, kind)
    if _IDENTIFIER_RE.fullmatch(name) is None:
        raise ConfigError(path, f"must match {IDENTIFIER_PATTERN}")
    return name


def _required(value: _T | None, path: str, kind: RuleKind) -> _T:
    if value is None:
        raise ConfigError(path, f"required for a rule of kind {kind!r}")
    return value


def _one_of(names: Iterable[str]) -> str:
    return " | ".join(names)


def _type_name(value: object) -> str:
    return "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"
