"""What routes, silences and inhibition rules look at in a notification, and their matchers
(rules, devices, severities; one left out matches everything)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gateway.domain.errors import ConfigError
from gateway.domain.rules import RULE_KEY_PATTERN, SEVERITIES, DeviceSelector, device_selector

_RULE_KEY_RE: Final = re.compile(RULE_KEY_PATTERN)


@dataclass(frozen=True, slots=True)
class Facts:
    """What routes and silences look at in a notification."""

    event: str
    device_id: str | None = None
    rule_key: str | None = None
    severity: str | None = None
    alarm_id: int | None = None


@dataclass(frozen=True, slots=True)
class Matchers:
    """Rules, devices and severities; None matches everything."""

    rules: frozenset[str] | None = None
    devices: DeviceSelector | None = None
    severities: frozenset[str] | None = None

    def matches(self, facts: Facts) -> bool:
        if self.rules is not None and facts.rule_key not in self.rules:
            return False
        if self.devices is not None and (
            facts.device_id is None or not self.devices.matches(facts.device_id)
        ):
            return False
        return self.severities is None or facts.severity in self.severities


def compile_matchers(
    *,
    rules: Sequence[str] | None,
    devices: str | Sequence[str] | None,
    severities: Sequence[str] | None,
    path: str,
) -> Matchers:
    """Validated matchers; a `ConfigError` names the key (``<path>.rules[2]``)."""
    if rules is not None:
        if not rules:
            raise ConfigError(f"{path}.rules", "must not be empty (leave it out to match all)")
        for index, rule in enumerate(rules):
            if _RULE_KEY_RE.match(rule) is None:
                raise ConfigError(f"{path}.rules[{index}]", f"invalid rule key {rule!r}")
    if severities is not None:
        if not severities:
            raise ConfigError(f"{path}.severities", "must not be empty (leave it out)")
        for index, severity in enumerate(severities):
            if severity not in SEVERITIES:
                raise ConfigError(
                    f"{path}.severities[{index}]",
                    f"unknown severity {severity!r}; known: {list(SEVERITIES)}",
                )
    return Matchers(
        rules=None if rules is None else frozenset(rules),
        devices=None if devices is None else device_selector(devices, f"{path}.devices"),
        severities=None if severities is None else frozenset(severities),
    )
