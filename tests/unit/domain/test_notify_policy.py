"""Sites, grouping of a route's notifications and inhibition rules: the pure part."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError
from gateway.domain.notify import Notify, compile_notify
from gateway.domain.notify_match import Facts
from gateway.domain.notify_policy import Grouping, inhibitor, source_rule_keys

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)

BASE = """
[[notify.receivers]]
name = "a"
kind = "webhook"
url = "http://127.0.0.1:1/a"

[[notify.receivers]]
name = "b"
kind = "webhook"
url = "http://127.0.0.1:1/b"

[[notify.sites]]
name = "north"
devices = ["gw-north", "north-*"]

[[notify.sites]]
name = "south"
devices = "south-*"
"""


def _rules(extra: str) -> Notify:
    return compile_notify(parse_config(BASE + extra).notify)


def _alarm(alarm_id: int, device: str, rule: str, severity: str = "MAJOR") -> Facts:
    return Facts(
        event="alarm.created", device_id=device, rule_key=rule, severity=severity, alarm_id=alarm_id
    )


def test_a_route_groups_by_its_labels_and_a_site_is_the_first_matching_selector() -> None:
    rules = _rules(
        '[[notify.routes]]\nreceivers = ["a"]\ngroup_by = ["site", "rule"]\ngroup_wait_s = 5\n'
        '[[notify.routes]]\nreceivers = ["b"]\n'
    )
    [(receiver, route)] = rules.targets(_alarm(1, "north-7", "silent"))
    assert receiver == "a"
    assert route.grouping is not None
    sites = rules.sites
    key, labels = route.grouping.group(route.index, _alarm(1, "north-7", "silent"), sites)
    assert (key, labels) == (
        "routes[0]{site=north,rule=silent}",
        {"site": "north", "rule": "silent"},
    )
    same, _ = route.grouping.group(route.index, _alarm(2, "gw-north", "silent"), sites)
    other, _ = route.grouping.group(route.index, _alarm(3, "south-1", "silent"), sites)
    nowhere, labels = route.grouping.group(route.index, _alarm(4, "east-1", "silent"), sites)
    assert same == key
    assert other != key
    assert labels == {"site": "", "rule": "silent"}  # a device in no site
    assert nowhere not in (key, other)


def test_without_group_by_no_grouping_and_a_receivers_first_route_decides() -> None:
    rules = _rules(
        '[[notify.routes]]\nreceivers = ["a"]\ncontinue = true\n'
        '[[notify.routes]]\nreceivers = ["a", "b"]\ngroup_by = ["rule"]\n'
    )
    targets = rules.targets(_alarm(1, "north-1", "hot"))
    assert [(r, route.index, route.grouping is None) for r, route in targets] == [
        ("a", 0, True),
        ("b", 1, False),
    ]
    assert rules.route(_alarm(1, "north-1", "hot")) == ["a", "b"]


def test_window_timing_follows_alertmanager() -> None:
    g = Grouping(by=("rule",), wait_s=30, interval_s=300, repeat_s=3600)
    # A new group: group_wait after its first notification.
    assert g.window_due(NOW, None) == NOW + timedelta(seconds=30)
    # A window after one due 100 s ago: group_interval after that one.
    last = NOW - timedelta(seconds=100)
    assert g.window_due(NOW, last) == last + timedelta(seconds=300)
    # A group quiet for longer than group_interval starts again with group_wait.
    assert g.window_due(NOW, NOW - timedelta(seconds=301)) == NOW + timedelta(seconds=30)


@pytest.mark.parametrize(
    ("routes", "key"),
    [
        ('group_by = ["room"]', "notify.routes[0].group_by[0]"),
        ('group_by = ["rule", "rule"]', "notify.routes[0].group_by"),
        ("group_wait_s = 10", "notify.routes[0].group_wait_s"),
        ("repeat_interval_s = 10", "notify.routes[0].repeat_interval_s"),
        ('group_by = ["rule"]\ngroup_interval_s = 0', "notify.routes[0].group_interval_s"),
        (
            'group_by = ["rule"]\ngroup_interval_s = 600\nrepeat_interval_s = 60',
            "notify.routes[0].repeat_interval_s",
        ),
        ('group_by = ["rule"]\ngroup_wait_s = -1', "notify.routes[0].group_wait_s"),
        ("group_max_notifications = 10", "notify.routes[0].group_max_notifications"),
        (
            'group_by = ["rule"]\ngroup_max_notifications = 0',
            "notify.routes[0].group_max_notifications",
        ),
    ],
)
def test_a_bad_grouping_is_a_config_error_naming_the_key(routes: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(BASE + f'[[notify.routes]]\nreceivers = ["a"]\n{routes}\n')
    assert caught.value.key_path == key, caught.value


def test_grouping_by_site_needs_sites() -> None:
    text = '[[notify.receivers]]\nname = "a"\nkind = "webhook"\nurl = "http://h"\n'
    with pytest.raises(ConfigError) as caught:
        parse_config(text + '[[notify.routes]]\nreceivers = ["a"]\ngroup_by = ["site"]\n')
    assert caught.value.key_path == "notify.routes[0].group_by[0]"
    assert "[[notify.sites]]" in str(caught.value)


@pytest.mark.parametrize(
    ("inhibit", "key"),
    [
        ('[notify.inhibit.source]\nseverities = ["MAJOR"]', "notify.inhibit[0].source.rules"),
        ('[notify.inhibit.source]\nrules = ["bad key"]', "notify.inhibit[0].source.rules[0]"),
        (
            'equal = ["room"]\n[notify.inhibit.source]\nrules = ["gw-silent"]',
            "notify.inhibit[0].equal[0]",
        ),
        (
            '[notify.inhibit.source]\nrules = ["gw-silent"]\n[notify.inhibit.target]\n'
            'severities = ["LOUD"]',
            "notify.inhibit[0].target.severities[0]",
        ),
        ('source = { rules = ["x"] }\nwhen = 1', "notify.inhibit[0].when"),
    ],
)
def test_a_bad_inhibit_rule_is_a_config_error_naming_the_key(inhibit: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(BASE + f"[[notify.inhibit]]\n{inhibit}\n")
    assert caught.value.key_path == key, caught.value


def test_a_bad_site_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(BASE + '[[notify.sites]]\nname = "north"\ndevices = "x-*"\n')
    assert caught.value.key_path == "notify.sites[2].name"


SITE_OFFLINE = """
[[notify.inhibit]]
name = "site-offline"
equal = ["site"]
[notify.inhibit.source]
rules = ["gateway-silent"]
[notify.inhibit.target]
rules = ["device-silent"]
"""


def test_a_sites_gateway_offline_mutes_its_devices_silent_alarms_and_only_those() -> None:
    rules = _rules(SITE_OFFLINE)
    assert source_rule_keys(rules.inhibit) == ["gateway-silent"]
    gateway = _alarm(1, "gw-north", "gateway-silent")
    sites = rules.sites
    found = inhibitor(rules.inhibit, _alarm(2, "north-3", "device-silent"), [gateway], sites)
    assert found is not None
    assert (found[0].name, found[1].alarm_id) == ("site-offline", 1)
    # Another site's device, another rule, a device in no site: notified.
    assert inhibitor(rules.inhibit, _alarm(3, "south-3", "device-silent"), [gateway], sites) is None
    assert inhibitor(rules.inhibit, _alarm(4, "north-3", "temp-high"), [gateway], sites) is None
    assert inhibitor(rules.inhibit, _alarm(5, "east-1", "device-silent"), [gateway], sites) is None
    # No open source: notified.
    assert inhibitor(rules.inhibit, _alarm(2, "north-3", "device-silent"), [], sites) is None


def test_an_alarm_never_inhibits_itself_and_a_command_notification_is_never_inhibited() -> None:
    rules = _rules(
        '[[notify.inhibit]]\nequal = ["device"]\n[notify.inhibit.source]\nrules = ["power-cut"]\n'
    )
    cut = _alarm(1, "pump-1", "power-cut", "CRITICAL")
    sites = rules.sites
    assert inhibitor(rules.inhibit, cut, [cut], sites) is None
    assert inhibitor(rules.inhibit, _alarm(2, "pump-1", "pressure-low"), [cut], sites) is not None
    assert inhibitor(rules.inhibit, _alarm(3, "pump-2", "pressure-low"), [cut], sites) is None
    failed = Facts(event="command.failed", device_id="pump-1")
    assert inhibitor(rules.inhibit, failed, [cut], sites) is None
