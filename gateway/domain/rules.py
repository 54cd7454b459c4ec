"""Alarm rules: their configuration, its validation, and the pure evaluation engine.

Nothing here does I/O or reads a clock: times come from the messages (device timestamps) or
from the caller (`now`).

The state of each (device, rule) — firing or not, pending samples, the device times that
order late samples — is a `RuleState`, a row of the `rule_state` table. The ingest
transaction of a batch reads the rows its messages touch (`state_keys`) under lock, lets
`evaluate` judge the messages in order against them, writes the outcomes, then writes the
rows back (the hold timer, `fire_held`, writes pending rows under the same locks); no process
keeps any of it between batches, so every node decides alike:

    states = {key: row for key, row in locked rows of the union of state_keys(...)}
    for device_id, event_id, message in batch:  # later messages see the earlier ones' effects
        evaluation = evaluate(rules, states, device_id, event_id, message)
        ...write evaluation.outcomes, in order...
    write back the entries of `states` that changed; commit

Per (device, rule), the outcomes of successive in-order evaluations alternate Firing,
Clearing, Firing... except that an event rule fires again on every new occurrence (the
database supersedes the previous alarm). Outcomes of one message must be written in their
order: a message carrying `DOOR_OPEN` then `DOOR_CLOSE` fires an alarm and then clears it.
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
import math
import re
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar, Final, Literal, TypeAlias, TypeGuard, TypeVar

import msgspec

from gateway.domain.alarm import CLEAR_PAIRS, Severity
from gateway.domain.errors import ConfigError
from protocol import MetricValue, Telemetry, is_valid_device_id
from protocol.ids import IDENTIFIER_PATTERN

RuleKind: TypeAlias = Literal["event", "threshold", "inactivity"]
Op: TypeAlias = Literal[">", ">=", "<", "<=", "==", "!="]

SEVERITIES: Final[tuple[Severity, ...]] = tuple(Severity)
RULE_KINDS: Final[tuple[RuleKind, ...]] = ("event", "threshold", "inactivity")
OPS: Final[tuple[Op, ...]] = (">", ">=", "<", "<=", "==", "!=")

_T = TypeVar("_T")

RULE_KEY_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,64}\Z"
DEFAULT_DEVICE_CACHE_SIZE: Final = 100_000

_RULE_KEY_RE: Final = re.compile(RULE_KEY_PATTERN)
_IDENTIFIER_RE: Final = re.compile(IDENTIFIER_PATTERN)
_GLOB_RE: Final = re.compile(r"^[A-Za-z0-9_.:\-*?\[\]!]{1,128}\Z")
_GLOB_MAGIC: Final = frozenset("*?[")
_SEVERITY_BY_NAME: Final[Mapping[str, Severity]] = {s.value: s for s in Severity}
_KIND_BY_NAME: Final[Mapping[str, RuleKind]] = {name: name for name in RULE_KINDS}
_OP_BY_NAME: Final[Mapping[str, Op]] = {name: name for name in OPS}
_NEGATED: Final[Mapping[Op, Op]] = {
    ">": "<=",
    ">=": "<",
    "<": ">=",
    "<=": ">",
    "==": "!=",
    "!=": "==",
}
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
        found = _DeviceRules.of(tuple(r for r in self.rules if r.selector.matches(device_id)))
        self._cache[device_id] = found
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return found


# --- validation ---------------------------------------------------------------------------


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
    metric = _identifier(config.metric, at("metric"), "threshold")
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
    elif not is_valid_device_id(pattern):
        raise ConfigError(path, f"invalid device id {pattern!r}: must match {IDENTIFIER_PATTERN}")


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


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _type_name(value: object) -> str:
    return "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"


# --- rule state ------------------------------------------------------------------------------

SlotKey: TypeAlias = tuple[str, str]  # (device_id, rule_key)


class RuleState(msgspec.Struct, frozen=True, gc=False):
    """The evaluation state of one (device, rule): one row of the `rule_state` table.

    Every time here is a device time (a sample's own timestamp), never a node's clock, so that
    every node judges the same samples alike. `last_ts`/`last_seq` order the samples: one older
    than the newest already judged is *late* (another node committed a newer one first), and a
    late sample never moves the state back (see `evaluate`).
    """

    firing: bool = False
    pending_count: int = 0  # consecutive violating samples of a threshold not yet fired
    pending_since: datetime | None = None  # the first of them
    last_ts: datetime | None = None  # the newest sample judged
    last_seq: int | None = None
    fired_ts: datetime | None = None  # the sample that raised the latest alarm
    fired_event_id: str | None = None
    released_ts: datetime | None = None  # the sample that cleared the latest alarm
    clear_ts: datetime | None = None  # the newest sample or event that says "clear"
    clear_event_id: str | None = None
    violating_ts: datetime | None = None  # the newest violating sample (thresholds)

    def rearmed(self) -> RuleState:
        """The same facts under a changed rule definition: pending samples no longer count."""
        return replace(self, pending_count=0, pending_since=None)


# A msgspec Struct, not a dataclass: evaluation replaces a state several times per sample, and
# msgspec's replace is about ten times cheaper than dataclasses.replace.
replace = msgspec.structs.replace


IDLE: Final = RuleState()

# The states of the (device, rule) pairs a batch touches, read under lock at the start of the
# batch's transaction; `evaluate` replaces entries as it goes. A missing key is `IDLE`.
RuleStates: TypeAlias = MutableMapping[SlotKey, RuleState]


# --- device clocks --------------------------------------------------------------------------


class ClockAdjustment(enum.StrEnum):
    """Why a sample was judged at another time than its device time, or ordered by its
    `seq` against what its device time says."""

    AHEAD = "ahead"  # dated further ahead of its receipt than max_future_skew
    BEHIND = "behind"  # further back than reorder_window from the newest already judged
    STATE_AHEAD = "state_ahead"  # the rule state held device times from a clock ahead
    # Its seq follows the newest judged, its time is before it (an NTP step back): newer,
    # judged at the newest time already judged.
    STEPPED_BACK = "stepped_back"
    # Its seq is below the newest judged, its time after it (a reboot): a new seq epoch,
    # judged at its device time.
    SEQ_RESET = "seq_reset"


@dataclass(frozen=True, slots=True)
class DeviceClock:
    """The bounds within which a device's own time orders its samples (docs/rules-and-alarms.md,
    "Device clocks"). Device time is evidence, not truth: a sample dated more than
    `max_future_skew` ahead of its receipt is judged at its receipt; one dated more than
    `reorder_window` before the newest sample already judged for its rules is a clock reset or
    a store-and-forward upload, not a reordering between nodes, and is judged at its receipt
    too (in arrival order): it neither moves a rule's state back to its old time nor holds the
    state at a bogus one."""

    max_future_skew: timedelta = timedelta(seconds=300)
    reorder_window: timedelta = timedelta(seconds=300)


def judged_time(
    sent: datetime, received: datetime, newest: datetime | None, clock: DeviceClock
) -> tuple[datetime, ClockAdjustment | None]:
    """The time a sample is judged at: its device time `sent` within the bounds of `clock`,
    else its receipt `received` (and why). `newest` is the newest time already judged for the
    rules it touches."""
    if sent > received + clock.max_future_skew:
        return received, ClockAdjustment.AHEAD
    if newest is not None and sent < newest - clock.reorder_window:
        return received, ClockAdjustment.BEHIND
    return sent, None


def seq_order(
    at: datetime, seq: int | None, newest: datetime | None, newest_seq: int | None
) -> tuple[datetime, ClockAdjustment | None]:
    """The time a sample judged at `at` (within the clock's bounds) is judged at once its
    `seq` is weighed against the newest sample already judged (`newest`, `newest_seq`).

    Where both have a seq, seq orders the device's samples inside an epoch, and a new epoch
    (seq dropping while time moves forward: a reboot) is newer than the last, in arrival
    order. A seq above the newest judged with a time before it is a clock stepped back (NTP),
    not a reordering: the sample is newer, judged at `newest` so that no state moves back. A
    seq below with a time after is a new epoch, judged at its time. Where seq and time agree,
    or either side has no seq, time alone orders (a reordering between nodes stays late)."""
    if seq is None or newest is None or newest_seq is None:
        return at, None
    if seq > newest_seq and at < newest:
        return newest, ClockAdjustment.STEPPED_BACK
    if seq < newest_seq and at > newest:
        return at, ClockAdjustment.SEQ_RESET
    return at, None


_STATE_TIMES: Final = (
    "pending_since",
    "last_ts",
    "fired_ts",
    "released_ts",
    "clear_ts",
    "violating_ts",
)


def _without_future(state: RuleState, received: datetime, clock: DeviceClock) -> RuleState | None:
    """`state` with every time further ahead of `received` than the skew allows brought back
    to `received` (written from a clock ahead before this model, such a time would hold the
    rule until real time passed it); None when it has none."""
    bound = received + clock.max_future_skew
    changes = {
        name: received
        for name in _STATE_TIMES
        if (value := getattr(state, name)) is not None and value > bound
    }
    return replace(state, **changes) if changes else None


def rule_version(rule: Rule) -> str:
    """A fingerprint of what a rule's state depends on (not its severity, devices or text).

    A state row written under another version keeps its facts (firing, the times) and drops
    its pending count: samples counted against `> 80` prove nothing about `> 90`.
    """
    if isinstance(rule, ThresholdRule):
        parts: list[object] = [
            rule.kind,
            rule.metric,
            rule.op,
            rule.value,
            rule.clear_value,
            rule.for_samples,
            rule.for_seconds,
        ]
    elif isinstance(rule, EventRule):
        parts = [rule.kind, rule.event]
    else:
        parts = [rule.kind]
    return hashlib.sha256(msgspec.json.encode(parts)).hexdigest()[:16]


def state_keys(rules: RuleSet, device_id: str, message: Telemetry) -> set[SlotKey]:
    """The (device, rule) pairs whose state `evaluate` reads or writes for this message."""
    device_rules = rules._device(device_id)
    keys: set[SlotKey] = set()
    if not device_rules.rules:
        return keys
    if message.events:
        for event_type in message.event_types():
            for rule in device_rules.events.get(event_type, ()):
                keys.add((device_id, rule.key))
            for rule in device_rules.cleared.get(event_type, ()):
                keys.add((device_id, rule.key))
    if message.metrics:
        for threshold in device_rules.thresholds:
            if threshold.metric in message.metrics:
                keys.add((device_id, threshold.key))
    return keys


# --- evaluation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Firing:
    """Raise an alarm for this sample.

    `superseded_by_event`: a late event occurrence older than the alarm raised since (by that
    telemetry event): in device order it came first, so its alarm is created already
    superseded by that one — and, with `cleared_by_event`, already cleared by the clear event
    that came between them.
    """

    rule_key: str
    severity: Severity
    device_id: str
    telemetry_event_id: str
    reason: str
    observed_at: datetime  # the message's device timestamp
    superseded_by_event: str | None = None
    cleared_by_event: str | None = None
    # Why it fired, stored with the alarm: see `trigger_of`.
    trigger: Mapping[str, Any] | None = field(default=None, compare=False)
    rule_description: str = ""


@dataclass(frozen=True)
class Clearing:
    """Clear the active alarm of (device, rule), by the sample `telemetry_event_id`.

    `raised_by_then`: a late clear, older than the alarm raised since. It clears the alarm
    that was active at its time instead — the newest raised by a sample at or before
    `raised_by_then` — if that one has not cleared yet.
    """

    rule_key: str
    device_id: str
    telemetry_event_id: str
    reason: str
    observed_at: datetime
    raised_by_then: datetime | None = None


Outcome: TypeAlias = Firing | Clearing


@dataclass(frozen=True)
class Evaluation:
    """What one message does: `outcomes`, to write in this order."""

    outcomes: tuple[Outcome, ...] = ()
    # Set when the message was judged at another time than its device time (its receipt,
    # the newest time judged), or ordered by its seq against its device time.
    clock_adjustment: ClockAdjustment | None = None
    # The time it was judged at, when `clock_adjustment` is set.
    judged_at: datetime | None = None

    @property
    def firings(self) -> tuple[Firing, ...]:
        return tuple(o for o in self.outcomes if isinstance(o, Firing))

    @property
    def clearings(self) -> tuple[Clearing, ...]:
        return tuple(o for o in self.outcomes if isinstance(o, Clearing))


class _Verdict(enum.Enum):
    VIOLATING = enum.auto()
    CLEAR = enum.auto()  # back past the clear threshold: re-arms a firing rule
    BAND = enum.auto()  # neither: inside the hysteresis band
    UNKNOWN = enum.auto()  # absent, or a type the comparison cannot judge


class _Run:
    """One message's evaluation: the states it reads and replaces, and its outcomes so far."""

    def __init__(
        self,
        states: RuleStates,
        device_id: str,
        event_id: str,
        observed_at: datetime,
        seq: int | None,
        *,
        sent_at: datetime | None = None,
    ) -> None:
        self.states = states
        self.device_id = device_id
        self.event_id = event_id
        self.observed_at = observed_at  # the time it is judged at
        self.sent_at = observed_at if sent_at is None else sent_at  # its device time
        self.seq = seq
        self.outcomes: list[Outcome] = []

    def get(self, rule: Rule) -> RuleState:
        return self.states.get((self.device_id, rule.key), IDLE)

    def put(self, rule: Rule, state: RuleState) -> None:
        self.states[(self.device_id, rule.key)] = state

    def fire(
        self,
        rule: Rule,
        reason: str,
        *,
        observed: MetricValue | None = None,
        superseded_by: str | None = None,
        cleared_by: str | None = None,
    ) -> None:
        self.outcomes.append(
            Firing(
                rule.key,
                rule.severity,
                self.device_id,
                self.event_id,
                reason,
                self.observed_at,
                superseded_by,
                cleared_by,
                trigger=self._trigger(rule, observed),
                rule_description=rule.description,
            )
        )

    def _trigger(self, rule: Rule, observed: MetricValue | None) -> dict[str, Any]:
        trigger = trigger_of(rule, self.observed_at, observed)
        if self.sent_at != self.observed_at:
            trigger["device_ts"] = self.sent_at.isoformat()  # judged at its receipt instead
        return trigger

    def clear(
        self,
        rule: Rule,
        reason: str,
        *,
        event_id: str | None = None,
        at: datetime | None = None,
        raised_by_then: datetime | None = None,
    ) -> None:
        self.outcomes.append(
            Clearing(
                rule.key,
                self.device_id,
                event_id or self.event_id,
                reason,
                at or self.observed_at,
                raised_by_then,
            )
        )

    def newest(self, state: RuleState) -> RuleState:
        """`state` with this sample as the newest judged, unless it is late: `last_ts` and
        `last_seq` are always the time and seq of one sample."""
        if self.is_late(state):
            return state
        return replace(state, last_ts=self.observed_at, last_seq=self.seq)

    def is_late(self, state: RuleState) -> bool:
        """Older than the newest sample judged for this (device, rule)."""
        last = state.last_ts
        if last is None or self.observed_at > last:
            return False
        if self.observed_at < last:
            return True
        return self.seq is not None and state.last_seq is not None and self.seq < state.last_seq


def trigger_of(
    rule: Rule, sample_ts: datetime, observed: MetricValue | None = None
) -> dict[str, Any]:
    """Why ``rule`` fired on the sample of ``sample_ts`` (RFC 3339), as the alarm keeps it:
    an event rule's event, a threshold rule's comparison and the value that broke it."""
    at = sample_ts.isoformat()
    if isinstance(rule, ThresholdRule):
        return {
            "metric": rule.metric,
            "op": rule.op,
            "threshold": rule.value,
            "value": observed,
            "sample_ts": at,
        }
    if isinstance(rule, EventRule):
        return {"event": rule.event, "sample_ts": at}
    return {"sample_ts": at}


def silence_trigger(silent_since: datetime) -> dict[str, Any]:
    """Why an inactivity rule fired: the device has been silent since then (RFC 3339)."""
    return {"silent_since": silent_since.isoformat()}


def evaluate(
    rules: RuleSet,
    states: RuleStates,
    device_id: str,
    event_id: str,
    message: Telemetry,
    *,
    received_at: datetime | None = None,
    clock: DeviceClock = DeviceClock(),
) -> Evaluation:
    """Judge one telemetry message of `device_id` (whose telemetry event id is `event_id`).

    Reads and replaces the entries of `states` for the pairs `state_keys` names; the caller
    writes them back in the transaction that writes the outcomes (or drops them on rollback).

    The ordering rule, for samples of one device committed out of order by several nodes:
    a late sample (older than the newest judged for that rule) is stored but never moves the
    state back. It still raises the alarm one node reading in device order would have raised,
    where nothing newer already stands for it: a late event becomes an alarm already cleared
    by its clear, or already superseded by the alarm raised since; a late violating sample of
    a rule that one sample fires raises its alarm, cleared if a newer sample cleared; one
    inside the current run of violations counts towards `for_samples`; a late clear clears
    the alarm that was active at its time (the firing one, if it is older and nothing has
    violated since). Otherwise it changes nothing: it never undoes what a newer sample
    decided.

    With `received_at` (the daemon always gives it), device time counts only within the bounds
    of `clock` (`judged_time`): outside them the message is judged at its receipt, and a rule
    state holding times from a clock ahead is brought back first. Without it, device time
    alone (the pure ordering rule above, for tests of it). Either way, where the message and
    the newest sample judged both have a seq, seq orders them first (`seq_order`).
    """
    device_rules = rules._device(device_id)
    if not device_rules.rules:
        return Evaluation()
    sent = message.timestamp()
    at, adjustment = sent, None
    newest: datetime | None = None
    newest_seq: int | None = None
    for key in state_keys(rules, device_id, message):
        state = states.get(key)
        if state is None:
            continue
        if received_at is not None:
            repaired = _without_future(state, received_at, clock)
            if repaired is not None:
                states[key] = state = repaired
                adjustment = ClockAdjustment.STATE_AHEAD
        last = state.last_ts
        if last is not None and (
            newest is None or last > newest or (last == newest and _seq_above(state, newest_seq))
        ):
            newest, newest_seq = last, state.last_seq
    if received_at is not None:
        at, judged = judged_time(sent, received_at, newest, clock)
        adjustment = judged or adjustment
    at, ordered = seq_order(at, message.seq, newest, newest_seq)
    adjustment = adjustment or ordered
    run = _Run(states, device_id, event_id, at, message.seq, sent_at=sent)
    if message.events:
        _judge_events(device_rules, message.event_types(), run)
    if message.metrics:
        for threshold in device_rules.thresholds:
            if threshold.metric in message.metrics:
                _judge_sample(threshold, message.metrics[threshold.metric], run)
    return Evaluation(tuple(run.outcomes), adjustment, None if adjustment is None else at)


def _seq_above(state: RuleState, seq: int | None) -> bool:
    return state.last_seq is not None and (seq is None or state.last_seq > seq)


def _judge_events(device_rules: _DeviceRules, event_types: Sequence[str], run: _Run) -> None:
    occurrences = Counter(event_types)
    fired: set[str] = set()
    for event_type in event_types:
        for rule in device_rules.events.get(event_type, ()):
            # One alarm per rule, device and telemetry event (the dedup key): repeats within
            # a message collapse, even after a clear in between.
            if rule.key not in fired:
                fired.add(rule.key)
                _occurred(rule, _event_reason(event_type, occurrences[event_type]), run)
        for rule in device_rules.cleared.get(event_type, ()):
            _clear_event(rule, event_type, run)


def _occurred(rule: EventRule, reason: str, run: _Run) -> None:
    state = run.get(rule)
    at = run.observed_at
    if state.fired_ts is not None and at < state.fired_ts:
        # Late, and older than the alarm raised since: that one superseded it; a clear event
        # between the two cleared it first.
        between = state.clear_ts is not None and at < state.clear_ts <= state.fired_ts
        run.fire(
            rule,
            reason,
            superseded_by=state.fired_event_id,
            cleared_by=state.clear_event_id if between else None,
        )
        run.put(rule, run.newest(state))
        return
    run.fire(rule, reason)
    state = replace(run.newest(state), firing=True, fired_ts=at, fired_event_id=run.event_id)
    if state.clear_ts is not None and state.clear_event_id is not None and at < state.clear_ts:
        # Late, and its own clear committed first: the event still happened.
        run.clear(
            rule,
            f"cleared by an event of {state.clear_ts.isoformat()} committed before it",
            event_id=state.clear_event_id,
            at=state.clear_ts,
        )
        state = replace(state, firing=False, released_ts=state.clear_ts)
    run.put(rule, state)


def _clear_event(rule: EventRule, event_type: str, run: _Run) -> None:
    state = run.get(rule)
    at = run.observed_at
    reason = f"{event_type} clears {rule.event}"
    if state.fired_ts is not None and at < state.fired_ts:
        run.clear(rule, reason, raised_by_then=at)  # late: the alarm of its time
    elif state.firing:
        run.clear(rule, reason)
        state = replace(state, firing=False, released_ts=at)
    if state.clear_ts is None or at >= state.clear_ts:
        state = replace(state, clear_ts=at, clear_event_id=run.event_id)
    run.put(rule, run.newest(state))


def _judge_sample(rule: ThresholdRule, observed: MetricValue, run: _Run) -> None:
    verdict = _verdict(rule, observed)
    if verdict is _Verdict.UNKNOWN:
        return
    state = run.get(rule)
    late = run.is_late(state)
    state = _noted(state, verdict, run)
    if late:
        _judge_late_sample(rule, observed, verdict, state, run)
        return
    at = run.observed_at
    state = run.newest(state)
    if state.firing:
        if verdict is _Verdict.CLEAR:
            run.clear(rule, _clear_reason(rule, observed))
            state = replace(state, firing=False, released_ts=at)
        run.put(rule, state)
    elif verdict is _Verdict.VIOLATING:
        since = at if state.pending_since is None else state.pending_since
        _count_violation(
            rule, observed, run, state, count=state.pending_count + 1, since=since, newest=at
        )
    else:
        run.put(rule, state.rearmed())


def _noted(state: RuleState, verdict: _Verdict, run: _Run) -> RuleState:
    """The newest violating and the newest clearing sample, whatever the commit order."""
    at = run.observed_at
    if verdict is _Verdict.VIOLATING and (state.violating_ts is None or at > state.violating_ts):
        return replace(state, violating_ts=at)
    if verdict is _Verdict.CLEAR and (state.clear_ts is None or at >= state.clear_ts):
        return replace(state, clear_ts=at, clear_event_id=run.event_id)
    return state


def _count_violation(
    rule: ThresholdRule,
    observed: MetricValue,
    run: _Run,
    state: RuleState,
    *,
    count: int,
    since: datetime,
    newest: datetime,
) -> None:
    held = newest - since
    if count >= rule.for_samples and held >= timedelta(seconds=rule.for_seconds):
        run.fire(rule, _threshold_reason(rule, observed, count, held), observed=observed)
        state = replace(state.rearmed(), firing=True, fired_ts=newest, fired_event_id=run.event_id)
    else:
        state = replace(state, pending_count=count, pending_since=since)
    run.put(rule, state)


def _judge_late_sample(
    rule: ThresholdRule, observed: MetricValue, verdict: _Verdict, state: RuleState, run: _Run
) -> None:
    """A sample older than the newest judged: it acts only where device order says it would
    have and nothing newer says otherwise (see `evaluate`)."""
    at = run.observed_at
    if verdict is _Verdict.CLEAR:
        if state.fired_ts is not None and at < state.fired_ts:
            # Older than the alarm raised since: it clears the alarm of its time, if any.
            run.clear(rule, _clear_reason(rule, observed), raised_by_then=at)
        elif state.firing and (state.violating_ts is None or state.violating_ts < at):
            # It cleared the firing alarm in device order, and nothing has violated since.
            run.clear(rule, _clear_reason(rule, observed))
            state = replace(state, firing=False, released_ts=at)
        run.put(rule, state)
        return
    if verdict is not _Verdict.VIOLATING or state.firing:
        run.put(rule, state)
        return
    newest = state.last_ts or at
    if state.pending_since is not None and state.pending_since <= at:
        # Inside the current run of violations: in device order it was one of them.
        since = state.pending_since
        _count_violation(
            rule, observed, run, state, count=state.pending_count + 1, since=since, newest=newest
        )
        return
    if (
        rule.for_samples > 1
        or rule.for_seconds > 0
        or (
            state.fired_ts is not None
            and (at < state.fired_ts or state.released_ts is None or at < state.released_ts)
        )
    ):
        # Which run of violations it belonged to is no longer known; or an alarm raised
        # since stands for it; or the rule was firing at its time.
        run.put(rule, state)
        return
    run.fire(rule, _threshold_reason(rule, observed, 1, timedelta(0)), observed=observed)
    state = replace(state, firing=True, fired_ts=at, fired_event_id=run.event_id)
    if state.clear_ts is not None and state.clear_event_id is not None and at < state.clear_ts:
        run.clear(
            rule,
            f"cleared by a sample of {state.clear_ts.isoformat()} committed before it",
            event_id=state.clear_event_id,
            at=state.clear_ts,
        )
        state = replace(state, firing=False, released_ts=state.clear_ts)
    run.put(rule, state)


def _verdict(rule: ThresholdRule, observed: MetricValue) -> _Verdict:
    if rule.op in ("==", "!="):
        holds = _same(observed, rule.value) == (rule.op == "==")
        return _Verdict.VIOLATING if holds else _Verdict.CLEAR
    threshold, clear_threshold = rule.value, rule.clear_threshold
    if not (_is_number(observed) and _is_number(threshold) and _is_number(clear_threshold)):
        return _Verdict.UNKNOWN
    if _holds(rule.op, observed, threshold):
        return _Verdict.VIOLATING
    back = observed < clear_threshold if rule.op in (">", ">=") else observed > clear_threshold
    return _Verdict.CLEAR if back else _Verdict.BAND


def _holds(op: Op, left: float, right: float) -> bool:
    match op:
        case ">":
            return left > right
        case ">=":
            return left >= right
        case "<":
            return left < right
        case "<=":
            return left <= right
        case "==":
            return left == right
        case "!=":
            return left != right


def _same(left: MetricValue, right: MetricValue) -> bool:
    """Equality that keeps kinds apart: `true` is not `1`, `"1"` is not `1`; `1 == 1.0`."""
    if isinstance(left, bool) or isinstance(right, bool):
        return isinstance(left, bool) and isinstance(right, bool) and left == right
    if isinstance(left, str) or isinstance(right, str):
        return isinstance(left, str) and isinstance(right, str) and left == right
    return left == right


def inactivity_firing(
    rule: InactivityRule, device_id: str, last_seen: datetime, now: datetime
) -> bool:
    """Whether `rule` applies to the device and it has been silent long enough."""
    return rule.selector.matches(device_id) and now - last_seen >= timedelta(
        seconds=rule.silent_seconds
    )


# --- holds on the clock ------------------------------------------------------------------
#
# A threshold rule with `for_seconds` fires when a sample shows the violation has held long
# enough; a device that reports by exception sends no such sample, so the hold timer
# (gateway.alarms.holds) also judges pending rows on the database clock. The hold is measured
# on the row's own timeline: device time up to the newest sample judged (`last_ts`, the same
# time `_count_violation` compares), then database time since that sample's batch wrote the
# row (`written_at`, the row's `updated_at`). Neither clock alone will do: `pending_since` is a
# device time, possibly hours behind the database's (a clock behind, a store-and-forward
# upload) — compared with the database's `now` it would fire at once — and the database's
# time since the first violation knows nothing of the samples between.


def hold_due_at(rule: ThresholdRule, state: RuleState, written_at: datetime) -> datetime | None:
    """The database time at which the pending violation of `state` has held `for_seconds`
    with no further sample, or None if the timer has nothing to judge: no hold, not pending,
    firing, or fewer than `for_samples` samples (those still have to arrive).

    `written_at` is when the row was last written; a write later than the newest sample's
    batch (a late sample counted) only makes the hold end later, never earlier."""
    since, last = state.pending_since, state.last_ts
    if (
        rule.for_seconds <= 0
        or state.firing
        or since is None
        or last is None
        or state.pending_count < rule.for_samples
    ):
        return None
    return written_at + (since + timedelta(seconds=rule.for_seconds) - last)


def hold_event_id(rule_key: str, device_id: str, pending_since: datetime) -> str:
    """The stand-in telemetry event id of an alarm the hold timer raises: derived from the
    stored run of violations, so every node computes the same dedup key for the same hold."""
    source = f"hold\n{rule_key}\n{device_id}\n{pending_since.isoformat()}".encode()
    return hashlib.sha256(source).hexdigest()


def fire_held(
    rule: ThresholdRule,
    device_id: str,
    state: RuleState,
    *,
    written_at: datetime,
    now: datetime,
) -> tuple[Firing, RuleState] | None:
    """The firing of a pending violation whose hold has passed by `now` (database time), and
    the state to write back; None if it is not due (see `hold_due_at`).

    The alarm is dated, in the row's timeline, when the hold completed (`pending_since +
    for_seconds`), which is after the newest sample judged. The next clearing sample clears
    it as it clears any firing alarm (even one dated before the hold completed: the device
    cleared in time, but said so too late); a late sample (older than the newest judged)
    leaves it. The value that violated is not kept in the row, so the trigger names the run's
    start and its length instead."""
    due = hold_due_at(rule, state, written_at)
    if due is None or due > now or not rule.selector.matches(device_id):
        return None
    since = state.pending_since
    assert since is not None  # hold_due_at checked it
    held = timedelta(seconds=rule.for_seconds)
    fired_ts = since + held
    event_id = hold_event_id(rule.key, device_id, since)
    reason = f"{rule.metric} {rule.op} {_show(rule.value)}"
    if state.pending_count > 1:
        reason += f" for {state.pending_count} samples"
    reason += f" held {held.total_seconds():g}s with no sample since (hold timer)"
    trigger = trigger_of(rule, fired_ts)
    trigger["pending_since"] = since.isoformat()
    trigger["pending_samples"] = state.pending_count
    firing = Firing(
        rule.key,
        rule.severity,
        device_id,
        event_id,
        reason,
        fired_ts,
        trigger=trigger,
        rule_description=rule.description,
    )
    fired = replace(state.rearmed(), firing=True, fired_ts=fired_ts, fired_event_id=event_id)
    return firing, fired


def _event_reason(event_type: str, occurrences: int) -> str:
    if occurrences == 1:
        return f"event {event_type}"
    return f"event {event_type} ({occurrences} occurrences in the message)"


def _threshold_reason(
    rule: ThresholdRule, observed: MetricValue, samples: int, held: timedelta
) -> str:
    reason = f"{rule.metric} {_show(observed)} {rule.op} {_show(rule.value)}"
    if samples > 1:
        reason += f" for {samples} samples"
    if rule.for_seconds > 0:
        reason += f" over {held.total_seconds():g}s"
    return reason


def _clear_reason(rule: ThresholdRule, observed: MetricValue) -> str:
    if rule.op in ("==", "!="):
        return f"{rule.metric} {_show(observed)} {_NEGATED[rule.op]} {_show(rule.value)}"
    back = "<" if rule.op in (">", ">=") else ">"
    return f"{rule.metric} {_show(observed)} {back} {_show(rule.clear_threshold)} (clear value)"


def _show(value: MetricValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    return str(value)
