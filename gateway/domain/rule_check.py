"""Rules that cannot fire: their metric or event has not been seen in stored telemetry.

A rule on a misspelled metric (``humidty``) or event (``DOOR_OPNE``) is valid configuration
and never fires. ``gateway rules check`` and the daemon's rule watch compare each rule's name
with the names seen in telemetry and suggest the closest ones (difflib). Inactivity rules
watch no name and are never reported.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from gateway.domain.rules import EventRule, Rule, ThresholdRule

Watched: TypeAlias = Literal["metric", "event"]

# difflib's default cutoff: `humidty` -> `humidity`, `DOOR_OPNE` -> `DOOR_OPEN`.
CLOSEST_CUTOFF: Final = 0.6
CLOSEST_COUNT: Final = 3


@dataclass(frozen=True, slots=True)
class WatchedName:
    """The metric or event a rule waits for."""

    rule_key: str
    watched: Watched
    name: str


@dataclass(frozen=True, slots=True)
class UnseenRule:
    """A rule whose name was not seen, with the seen names closest to it (best first)."""

    rule_key: str
    watched: Watched
    name: str
    closest: tuple[str, ...]

    def describe(self) -> str:
        hint = f"; closest seen: {', '.join(self.closest)}" if self.closest else ""
        return f"rule {self.rule_key!r}: {self.watched} {self.name!r} not seen{hint}"


def watched_name(rule: Rule) -> WatchedName | None:
    if isinstance(rule, ThresholdRule):
        return WatchedName(rule.key, "metric", rule.metric)
    if isinstance(rule, EventRule):
        return WatchedName(rule.key, "event", rule.event)
    return None  # inactivity: any message counts


def watched_names(rules: Iterable[Rule]) -> list[WatchedName]:
    return [found for rule in rules if (found := watched_name(rule)) is not None]


def closest(name: str, seen: Collection[str]) -> tuple[str, ...]:
    return tuple(difflib.get_close_matches(name, seen, n=CLOSEST_COUNT, cutoff=CLOSEST_CUTOFF))


def unseen(
    watched: WatchedName, *, seen_metrics: Collection[str], seen_events: Collection[str]
) -> UnseenRule | None:
    """``None`` when the name was seen; otherwise the report, with the closest seen names."""
    seen = seen_metrics if watched.watched == "metric" else seen_events
    if watched.name in seen:
        return None
    return UnseenRule(watched.rule_key, watched.watched, watched.name, closest(watched.name, seen))
