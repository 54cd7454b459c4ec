"""Notification policy beyond routing (docs/notifications.md): sites, Alertmanager-style
grouping of a route's notifications, and inhibition rules. Pure: no I/O, no clock reads.

**Sites** (``[[notify.sites]]``) name groups of devices by the rules' device selector syntax;
a device belongs to the first site whose selector matches it (or to none). Grouping and
inhibition use a site like any other label.

**Grouping** (a route's ``group_by``): the notifications a route sends one receiver are
gathered by the values of their labels (``rule``, ``device``, ``severity``, ``site``) into
*windows*; one delivery per window carries all of them. The first window of a group (or the
first after it was quiet for ``group_interval_s``) is sent ``group_wait_s`` after its first
notification; each later one ``group_interval_s`` after the window before it was due. A group
whose last window was sent, and whose alarms are still open ``repeat_interval_s`` later, is
sent again (the still open ones, marked ``repeat``).

**Inhibition** (``[[notify.inhibit]]``): while an alarm matching a rule's ``source`` is open
(not cleared, not dealt with), the notifications of alarms matching its ``target`` that agree
with the source on every ``equal`` label are not sent (they are made, ``INHIBITED``). An alarm
never inhibits itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Final

from msgspec import Meta, Struct, field

from gateway.domain.errors import ConfigError
from gateway.domain.notify_match import Facts, Matchers, compile_matchers
from gateway.domain.rules import DeviceSelector, device_selector

LABELS: Final[tuple[str, ...]] = ("rule", "device", "severity", "site")
# Alertmanager's defaults.
GROUP_WAIT_S: Final = 30.0
GROUP_INTERVAL_S: Final = 300.0
REPEAT_INTERVAL_S: Final = 14400.0
# Notifications one window (one delivery) lists at most: a webhook body of ~250 KB, an e-mail
# of ~1 MB, under nginx's default client_max_body_size (1 MiB) and Postfix's message_size_limit.
GROUP_MAX_NOTIFICATIONS: Final = 200
_SITE_NAME_MAX: Final = 64

NonNegative = Annotated[float, Meta(ge=0)]


class SiteConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[notify.sites]]`` table."""

    name: str
    devices: str | list[str]


class InhibitSourceConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The open alarms that inhibit: ``rules`` is required (the alarms looked up are those)."""

    rules: list[str] | None = None
    severities: list[str] | None = None
    devices: str | list[str] | None = None


class InhibitTargetConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The notifications inhibited; an omitted matcher matches everything."""

    rules: list[str] | None = None
    severities: list[str] | None = None
    devices: str | list[str] | None = None


class InhibitConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[notify.inhibit]]`` table."""

    name: str = ""
    source: InhibitSourceConfig
    target: InhibitTargetConfig = field(default_factory=InhibitTargetConfig)
    equal: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Sites:
    entries: tuple[tuple[str, DeviceSelector], ...] = ()

    def of(self, device_id: str | None) -> str | None:
        if device_id is None:
            return None
        return next((name for name, sel in self.entries if sel.matches(device_id)), None)


def labels_of(facts: Facts, sites: Sites) -> dict[str, str | None]:
    return {
        "rule": facts.rule_key,
        "device": facts.device_id,
        "severity": facts.severity,
        "site": sites.of(facts.device_id),
    }


@dataclass(frozen=True, slots=True)
class Grouping:
    """A route's ``group_by`` and its intervals (seconds)."""

    by: tuple[str, ...]
    wait_s: float = GROUP_WAIT_S
    interval_s: float = GROUP_INTERVAL_S
    repeat_s: float = REPEAT_INTERVAL_S
    # At most this many notifications a window (a repeat: alarms a part); a full window
    # takes no more, and the next one is due when it is.
    max_notifications: int = GROUP_MAX_NOTIFICATIONS

    def group(self, route: int, facts: Facts, sites: Sites) -> tuple[str, dict[str, str]]:
        """The group's key (unique per route and label values) and its labels (a label the
        notification lacks is the empty string)."""
        values = labels_of(facts, sites)
        labels = {name: values[name] or "" for name in self.by}
        inner = ",".join(f"{name}={value}" for name, value in labels.items())
        return f"routes[{route}]{{{inner}}}", labels

    def window_due(self, now: datetime, last_due: datetime | None) -> datetime:
        """When a new window of the group is sent: ``group_wait_s`` after now for a group
        with no window in the last ``group_interval_s``; else ``group_interval_s`` after the
        window before it was due."""
        interval = timedelta(seconds=self.interval_s)
        if last_due is None or now >= last_due + interval:
            return now + timedelta(seconds=self.wait_s)
        return last_due + interval


@dataclass(frozen=True, slots=True)
class InhibitRule:
    name: str
    source: Matchers
    target: Matchers
    equal: tuple[str, ...]

    def inhibits(self, source: Facts, target: Facts, sites: Sites) -> bool:
        if source.alarm_id is not None and source.alarm_id == target.alarm_id:
            return False
        if not (self.source.matches(source) and self.target.matches(target)):
            return False
        a, b = labels_of(source, sites), labels_of(target, sites)
        return all(a[name] is not None and a[name] == b[name] for name in self.equal)


def inhibitor(
    rules: Sequence[InhibitRule], target: Facts, open_alarms: Sequence[Facts], sites: Sites
) -> tuple[InhibitRule, Facts] | None:
    """The first (rule, open source alarm) that inhibits an alarm's notification, or None.
    Only alarm notifications are inhibited."""
    if target.alarm_id is None:
        return None
    for rule in rules:
        for source in open_alarms:
            if rule.inhibits(source, target, sites):
                return rule, source
    return None


def source_rule_keys(rules: Sequence[InhibitRule]) -> list[str]:
    """Every rule key an inhibition source names: the open alarms worth looking up."""
    keys: set[str] = set()
    for rule in rules:
        keys |= rule.source.rules or frozenset()
    return sorted(keys)


# --- compiling ---------------------------------------------------------------------------------


def compile_sites(sites: Sequence[SiteConfig], path: str) -> Sites:
    seen: set[str] = set()
    entries = []
    for index, site in enumerate(sites):
        at = f"{path}[{index}]"
        if not site.name or len(site.name) > _SITE_NAME_MAX or not site.name.isprintable():
            raise ConfigError(f"{at}.name", "a site needs a name (1-64 printable characters)")
        if site.name in seen:
            raise ConfigError(f"{at}.name", f"site {site.name!r} is defined twice")
        seen.add(site.name)
        entries.append((site.name, device_selector(site.devices, f"{at}.devices")))
    return Sites(tuple(entries))


def _labels(names: Sequence[str], path: str, sites: Sites) -> tuple[str, ...]:
    for index, name in enumerate(names):
        if name not in LABELS:
            raise ConfigError(f"{path}[{index}]", f"unknown label {name!r}; known: {list(LABELS)}")
        if name == "site" and not sites.entries:
            raise ConfigError(f"{path}[{index}]", "'site' needs [[notify.sites]]")
    if len(set(names)) != len(names):
        raise ConfigError(path, "names a label twice")
    return tuple(names)


def compile_grouping(
    *,
    group_by: Sequence[str] | None,
    wait_s: float | None,
    interval_s: float | None,
    repeat_s: float | None,
    path: str,
    sites: Sites,
    max_notifications: int | None = None,
) -> Grouping | None:
    """A route's grouping, or None (one delivery per notification, as without grouping)."""
    if group_by is None:
        for key, value in (
            ("group_wait_s", wait_s),
            ("group_interval_s", interval_s),
            ("repeat_interval_s", repeat_s),
            ("group_max_notifications", max_notifications),
        ):
            if value is not None:
                raise ConfigError(f"{path}.{key}", "applies only to a route with group_by")
        return None
    grouping = Grouping(
        by=_labels(group_by, f"{path}.group_by", sites),
        wait_s=GROUP_WAIT_S if wait_s is None else wait_s,
        interval_s=GROUP_INTERVAL_S if interval_s is None else interval_s,
        repeat_s=REPEAT_INTERVAL_S if repeat_s is None else repeat_s,
        max_notifications=(
            GROUP_MAX_NOTIFICATIONS if max_notifications is None else max_notifications
        ),
    )
    if grouping.max_notifications < 1:
        raise ConfigError(f"{path}.group_max_notifications", "must be at least 1")
    if grouping.interval_s <= 0:
        raise ConfigError(f"{path}.group_interval_s", "must be greater than 0")
    if grouping.repeat_s and grouping.repeat_s < grouping.interval_s:
        raise ConfigError(
            f"{path}.repeat_interval_s",
            f"must be 0 (never repeat) or at least group_interval_s ({grouping.interval_s:g})",
        )
    return grouping


def compile_inhibit(
    rules: Sequence[InhibitConfig], path: str, sites: Sites
) -> tuple[InhibitRule, ...]:
    compiled = []
    for index, rule in enumerate(rules):
        at = f"{path}[{index}]"
        if rule.source.rules is None:
            raise ConfigError(f"{at}.source.rules", "required: the rule keys of the source alarms")
        source = compile_matchers(
            rules=rule.source.rules,
            devices=rule.source.devices,
            severities=rule.source.severities,
            path=f"{at}.source",
        )
        target = compile_matchers(
            rules=rule.target.rules,
            devices=rule.target.devices,
            severities=rule.target.severities,
            path=f"{at}.target",
        )
        compiled.append(
            InhibitRule(
                name=rule.name or f"inhibit[{index}]",
                source=source,
                target=target,
                equal=_labels(rule.equal, f"{at}.equal", sites),
            )
        )
    return tuple(compiled)


def facts_of_alarm(row: Mapping[str, object]) -> Facts:
    """An open alarm as a possible inhibition source."""
    return Facts(
        event="alarm.open",
        device_id=str(row["device_id"]),
        rule_key=str(row["rule_key"]),
        severity=str(row["severity"]),
        alarm_id=int(str(row["id"])),
    )
