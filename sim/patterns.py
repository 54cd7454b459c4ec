"""What simulated devices say: telemetry patterns, pure and seeded, with no clock of their own.

A device's next message depends only on its state, the random generator it was given and the
``now_ms`` its caller passes, so the same seed and the same calls give the same messages.

- ``walk``: ``temp``, ``humidity`` and a slowly draining ``battery``; ``temp`` wanders around
  its own baseline, well below `PatternParams.clear_below`, and with `crossing_probability` per
  message spikes above `PatternParams.threshold` for a few samples, then falls back: a threshold
  rule ``temp > 80`` with ``clear_value = 75`` fires and clears.
- ``door``, ``sos``, ``smoke``, ``water_leak``, ``power``: ``battery`` readings, and now and then
  an event followed a few messages later by its clear event (``DOOR_OPEN`` … ``DOOR_CLOSE``),
  never two opens without the clear in between.
- ``silent``: readings like ``walk`` (without spikes) for `active_messages` messages, then
  nothing for `silence_s` (long enough for an inactivity rule), then readings again, and so on.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final

from protocol import MetricValue, Telemetry

MAX_DEVICES: Final = 50_000


class Pattern(StrEnum):
    WALK = "walk"
    DOOR = "door"
    SOS = "sos"
    SMOKE = "smoke"
    WATER_LEAK = "water_leak"
    POWER = "power"
    SILENT = "silent"


EVENT_TYPES: Final[Mapping[Pattern, tuple[str, str]]] = MappingProxyType(
    {
        Pattern.DOOR: ("DOOR_OPEN", "DOOR_CLOSE"),
        Pattern.SOS: ("SOS", "SOS_CLEAR"),
        Pattern.SMOKE: ("SMOKE", "SMOKE_CLEAR"),
        Pattern.WATER_LEAK: ("WATER_LEAK", "WATER_LEAK_CLEAR"),
        Pattern.POWER: ("POWER_OFF", "POWER_ON"),
    }
)
"""Each event pattern's (event, clear event) types."""

DEFAULT_MIX: Final = "walk=70,door=10,sos=5,smoke=5,water_leak=5,power=3,silent=2"

Mix = Mapping[Pattern, float]
"""Pattern weights, in the order given; only their ratios matter."""


@dataclass(frozen=True)
class PatternParams:
    """Knobs shared by every device of a fleet."""

    crossing_probability: float = 0.01
    """Per ``walk`` message: the chance that ``temp`` spikes above `threshold`."""
    threshold: float = 80.0
    clear_below: float = 75.0
    spike_samples: tuple[int, int] = (1, 3)
    """How many consecutive samples a spike stays above `threshold` (inclusive range)."""
    event_probability: float = 0.05
    """Per message of an event device with nothing open: the chance of the event."""
    clear_after: tuple[int, int] = (2, 8)
    """The clear event comes this many messages after its event (inclusive range)."""
    active_messages: int = 20
    """Messages a ``silent`` device sends between two silences."""
    silence_s: float = 120.0
    battery_drain: float = 0.01
    """Battery percent used per message, on average."""

    def __post_init__(self) -> None:
        for name in ("crossing_probability", "event_probability"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if not self.threshold > self.clear_below:
            raise ValueError(
                f"threshold ({self.threshold}) must be above clear_below ({self.clear_below})"
            )
        for name in ("spike_samples", "clear_after"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {(low, high)}")
        if self.active_messages < 1:
            raise ValueError(f"active_messages must be at least 1, got {self.active_messages}")
        if not (math.isfinite(self.silence_s) and self.silence_s > 0):
            raise ValueError(f"silence_s must be a number of seconds > 0, got {self.silence_s}")
        if not (math.isfinite(self.battery_drain) and self.battery_drain >= 0):
            raise ValueError(f"battery_drain must be >= 0, got {self.battery_drain}")


def parse_mix(text: str) -> dict[Pattern, float]:
    """``"walk=70,door=30"`` → ``{WALK: 70.0, DOOR: 30.0}``; a `ValueError` says what is wrong."""
    known = ", ".join(pattern.value for pattern in Pattern)
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ValueError(f"the mix is empty: expected name=weight pairs of {known}")
    mix: dict[Pattern, float] = {}
    for item in items:
        name, equals, weight_text = (part.strip() for part in item.partition("="))
        if not equals or not name or not weight_text:
            raise ValueError(f"mix entry {item!r} is not name=weight (e.g. walk=70)")
        try:
            pattern = Pattern(name)
        except ValueError:
            raise ValueError(f"unknown pattern {name!r} in the mix; known: {known}") from None
        if pattern in mix:
            raise ValueError(f"pattern {name!r} appears twice in the mix")
        try:
            weight = float(weight_text)
        except ValueError:
            raise ValueError(f"weight of {name!r} is not a number: {weight_text!r}") from None
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight of {name!r} must be a finite number >= 0, got {weight_text}")
        mix[pattern] = weight
    if not any(mix.values()):
        raise ValueError("the mix needs at least one weight above 0")
    return mix


def check_device_count(count: int) -> int:
    if not 1 <= count <= MAX_DEVICES:
        raise ValueError(f"the number of devices must be within 1..{MAX_DEVICES}, got {count}")
    return count


def pattern_counts(count: int, mix: Mix) -> dict[Pattern, int]:
    """How many of ``count`` devices follow each pattern: the weights' shares, rounded by the
    largest-remainder method (ties to the earlier pattern in the mix), summing to ``count``."""
    check_device_count(count)
    total = sum(mix.values())
    if not total > 0:
        raise ValueError("the mix needs at least one weight above 0")
    quotas = {pattern: count * weight / total for pattern, weight in mix.items()}
    counts = {pattern: math.floor(quota) for pattern, quota in quotas.items()}
    order = list(mix)
    by_remainder = sorted(order, key=lambda p: (-(quotas[p] - counts[p]), order.index(p)))
    for pattern in by_remainder[: count - sum(counts.values())]:
        counts[pattern] += 1
    return counts


def assign_patterns(count: int, mix: Mix, seed: int) -> list[Pattern]:
    """The pattern of each device index: `pattern_counts`, shuffled by ``seed``."""
    patterns = [pattern for pattern, n in pattern_counts(count, mix).items() for _ in range(n)]
    random.Random(f"mix:{seed}").shuffle(patterns)
    return patterns


def mix_summary(patterns: Sequence[Pattern]) -> dict[Pattern, int]:
    """Devices per pattern, in `Pattern` order, patterns with none left out."""
    counted = Counter(patterns)
    return {pattern: counted[pattern] for pattern in Pattern if counted[pattern]}


class SimDevice:
    """One simulated device: `next_message` is its next telemetry, or None while silent.

    ``rng`` may be shared by a whole fleet (one generator for 50,000 devices, instead of one
    each at ~2.5 kB apiece): messages then depend on the order devices are asked in, which the
    fleet keeps deterministic.
    """

    __slots__ = (
        "_base_temp",
        "_battery",
        "_clear_in",
        "_humidity",
        "_is_open",
        "_rng",
        "_sent_in_cycle",
        "_silent_until_ms",
        "_spike_left",
        "_temp",
        "device_id",
        "params",
        "pattern",
        "seq",
    )

    def __init__(
        self, device_id: str, pattern: Pattern, params: PatternParams, rng: random.Random
    ) -> None:
        self.device_id = device_id
        self.pattern = Pattern(pattern)
        self.params = params
        self.seq = 0
        """The next message's sequence number."""
        self._rng = rng
        self._base_temp = rng.uniform(18.0, 26.0)
        self._temp = self._base_temp
        self._humidity = rng.uniform(35.0, 60.0)
        self._battery = rng.uniform(60.0, 100.0)
        self._spike_left = 0
        self._is_open = False
        self._clear_in = 0
        self._sent_in_cycle = 0
        self._silent_until_ms: int | None = None

    def next_message(self, now_ms: int) -> Telemetry | None:
        if self.pattern is Pattern.SILENT and self._silent(now_ms):
            return None
        events: list[dict[str, Any]] | None = None
        metrics: dict[str, MetricValue] | None = None
        if self.pattern in EVENT_TYPES:
            events = self._event()
            if events is None:
                metrics = {"battery": self._drain()}
        else:
            metrics = {
                "temp": self._walk_temp(spikes=self.pattern is Pattern.WALK),
                "humidity": self._walk_humidity(),
                "battery": self._drain(),
            }
        message = Telemetry(ts=now_ms, seq=self.seq, metrics=metrics, events=events)
        self.seq += 1
        return message

    def _silent(self, now_ms: int) -> bool:
        if self._silent_until_ms is not None:
            if now_ms < self._silent_until_ms:
                return True
            self._silent_until_ms = None
            self._sent_in_cycle = 0
        if self._sent_in_cycle >= self.params.active_messages:
            self._silent_until_ms = now_ms + round(self.params.silence_s * 1000)
            return True
        self._sent_in_cycle += 1
        return False

    def _event(self) -> list[dict[str, Any]] | None:
        opened, cleared = EVENT_TYPES[self.pattern]
        if self._is_open:
            self._clear_in -= 1
            if self._clear_in > 0:
                return None
            self._is_open = False
            return [{"type": cleared}]
        if self._rng.random() < self.params.event_probability:
            self._is_open = True
            self._clear_in = self._rng.randint(*self.params.clear_after)
            return [{"type": opened}]
        return None

    def _walk_temp(self, *, spikes: bool) -> float:
        params = self.params
        if self._spike_left == 0 and spikes and self._rng.random() < params.crossing_probability:
            self._spike_left = self._rng.randint(*params.spike_samples)
        if self._spike_left > 0:
            self._spike_left -= 1
            return round(params.threshold + self._rng.uniform(0.5, 8.0), 2)
        # Mean-reverting, and capped a clear margin below `clear_below`: only spikes cross.
        step = 0.2 * (self._base_temp - self._temp) + self._rng.gauss(0.0, 0.4)
        ceiling = min(self._base_temp + 10.0, params.clear_below - 1.0)
        self._temp = min(ceiling, max(self._base_temp - 10.0, self._temp + step))
        return round(self._temp, 2)

    def _walk_humidity(self) -> float:
        self._humidity = min(95.0, max(10.0, self._humidity + self._rng.gauss(0.0, 0.5)))
        return round(self._humidity, 1)

    def _drain(self) -> float:
        used = self.params.battery_drain * self._rng.uniform(0.5, 1.5)
        self._battery = max(0.0, self._battery - used)
        return round(self._battery, 2)


def fleet(
    device_ids: Sequence[str], mix: Mix, *, seed: int, params: PatternParams
) -> list[SimDevice]:
    """One device per id, patterns from `assign_patterns`, one generator seeded by ``seed``."""
    patterns = assign_patterns(len(device_ids), mix, seed)
    rng = random.Random(seed)
    return [
        SimDevice(device_id, pattern, params, rng)
        for device_id, pattern in zip(device_ids, patterns, strict=True)
    ]
