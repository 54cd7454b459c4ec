"""The validated rules (`Rule` and its kinds), the device selectors they apply to, and
`RuleSet`, which indexes them per device for evaluation."""

from __future__ import annotations

import fnmatch
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Final, Literal, TypeAlias, TypeGuard

from gateway.domain.alarm import CLEAR_PAIRS, Severity
from protocol import MetricValue

__all__ = [
    "ALL_DEVICES",
    "DEFAULT_DEVICE_CACHE_SIZE",
    "OPS",
    "RULE_KINDS",
    "SEVERITIES",
    "DeviceSelector",
    "EventRule",
    "InactivityRule",
    "Op",
    "Rule",
    "RuleKind",
    "RuleSet",
    "ThresholdRule",
]


RuleKind: TypeAlias = Literal["event", "threshold", "inactivity"]
Op: TypeAlias = Literal[">", ">=", "<", "<=", "==", "!="]

SEVERITIES: Final[tuple[Severity, ...]] = tuple(Severity)
RULE_KINDS: Final[tuple[RuleKind, ...]] = ("event", "threshold", "inactivity")
OPS: Final[tuple[Op, ...]] = (">", ">=", "<", "<=", "==", "!=")


DEFAULT_DEVICE_CACHE_SIZE: Final = 100_000

_GLOB_MAGIC: Final = frozenset("*?[")


def _is_glob(pattern: str) -> bool:
    return not _GLOB_MAGIC.isdisjoint(pattern)


@dataclass(frozen=True)
class DeviceSelector:
    """Device ids and `fnmatch` globs (case-sensitive); a device matches if any entry does."""

    patterns: tuple[str, ...]
    _exact: frozenset[str] = field(init=False, repr=False, compare=False)
    _glob: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        globs = [pattern for pattern in self.patterns if _is_glob(pattern)]
        regex = "|".join(f"(?:{fnmatch.translate(glob)})" for glob in globs)
        object.__setattr__(self, "_exact", frozenset(p for p in self.patterns if not _is_glob(p)))
        object.__setattr__(self, "_glob", re.compile(regex) if globs else None)

    def matches(self, device_id: str) -> bool:
        if device_id in self._exact:
            return True
        return self._glob is not None and self._glob.match(device_id) is not None


ALL_DEVICES: Final = DeviceSelector(("*",))


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A validated rule; build them with `compile_rules` (the constructors do not validate)."""

    kind: ClassVar[RuleKind]
    key: str
    severity: Severity
    selector: DeviceSelector = ALL_DEVICES
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class EventRule(Rule):
    kind: ClassVar[RuleKind] = "event"
    event: str


@dataclass(frozen=True, kw_only=True)
class ThresholdRule(Rule):
    kind: ClassVar[RuleKind] = "threshold"
    metric: str
    op: Op
    value: MetricValue
    # Ordering ops only; `None` means `value` (no hysteresis).
    clear_value: int | float | None = None
    for_samples: int = 1
    for_seconds: float = 0.0

    @property
    def clear_threshold(self) -> MetricValue:
        return self.value if self.clear_value is None else self.clear_value


@dataclass(frozen=True, kw_only=True)
class InactivityRule(Rule):
    kind: ClassVar[RuleKind] = "inactivity"
    silent_seconds: float


@dataclass(frozen=True)
class _DeviceRules:
    """The rules that apply to one device, indexed the way `evaluate` looks them up."""

    rules: tuple[Rule, ...]
    events: Mapping[str, tuple[EventRule, ...]]
    cleared: Mapping[str, tuple[EventRule, ...]]  # clear event type -> the rules it clears
    thresholds: tuple[ThresholdRule, ...]
    inactivity: tuple[InactivityRule, ...]

    @classmethod
    def of(cls, rules: tuple[Rule, ...]) -> _DeviceRules:
        events: dict[str, list[EventRule]] = {}
        cleared: dict[str, list[EventRule]] = {}
        for rule in rules:
            if isinstance(rule, EventRule):
                events.setdefault(rule.event, []).append(rule)
                for clear_event, types in CLEAR_PAIRS.items():
                    if rule.event in types:
                        cleared.setdefault(clear_event, []).append(rule)
        return cls(
            rules=rules,
            events={name: tuple(found) for name, found in events.items()},
            cleared={name: tuple(found) for name, found in cleared.items()},
            thresholds=tuple(r for r in rules if isinstance(r, ThresholdRule)),
            inactivity=tuple(r for r in rules if isinstance(r, InactivityRule)),
        )


class RuleSet:
    """An immutable set of rules (in configuration order) with a bounded per-device cache."""

    def __init__(
        self, rules: Iterable[Rule] = (), *, cache_size: int = DEFAULT_DEVICE_CACHE_SIZE
    ) -> None:
        self.rules: Final = tuple(rules)
        self._by_key: Final = {rule.key: rule for rule in self.rules}
        if len(self._by_key) != len(self.rules):
            raise ValueError("rule keys must be unique")
        self.inactivity_rules: Final = tuple(
            rule for rule in self.rules if isinstance(rule, InactivityRule)
        )
        self._events: Final = _DeviceRules.of(self.rules).events
        self._cache_size: Final = max(1, cache_size)
        self._cache: OrderedDict[str, _DeviceRules] = OrderedDict()
        # One _DeviceRules per set of rules that apply, whatever the devices it serves: a
        # fleet has few such sets, and its own copy per device was ~800 bytes (10,000
        # devices, 8 MB) and most of the 9 us a device's first message took here.
        self._shared: dict[tuple[int, ...], _DeviceRules] = {}

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def by_key(self, key: str) -> Rule | None:
        return self._by_key.get(key)

    def for_device(self, device_id: str) -> tuple[Rule, ...]:
        return self._device(device_id).rules

    def event_rules_for(self, event_type: str) -> tuple[EventRule, ...]:
        """Every event rule of that type, whatever its devices."""
        return self._events.get(event_type, ())

    def _device(self, device_id: str) -> _DeviceRules:
        cached = self._cache.get(device_id)
        if cached is not None:
            self._cache.move_to_end(device_id)
            return cached
        applying = tuple(n for n, r in enumerate(self.rules) if r.selector.matches(device_id))
        found = self._shared.get(applying)
        if found is None:
            if len(self._shared) >= self._cache_size:  # as many sets as devices: no sharing
                self._shared.clear()
            found = _DeviceRules.of(tuple(self.rules[n] for n in applying))
            self._shared[applying] = found
        self._cache[device_id] = found
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return found


def _is_number(value: object) -> TypeGuard[int | float]:
    kind = type(value)
    if kind is float or kind is int:  # what decoding gives: the common case, first
        return True
    return isinstance(value, int | float) and not isinstance(value, bool)
