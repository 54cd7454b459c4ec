"""Routes (first match, `continue`), silences, what an outbox event means, the signature."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from gateway.config import load_config, parse_config
from gateway.domain.errors import ConfigError
from gateway.domain.notify import (
    Facts,
    NotifyConfig,
    alarm_link,
    compile_matchers,
    compile_notify,
    first_silence,
    notification_of,
    route_of_group,
    signature,
    silence_from_row,
    verify_signature,
)
from protocol.events import EventType
from tests.support import events

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)

RECEIVERS = """
[[notify.receivers]]
name = "a"
kind = "webhook"
url = "http://127.0.0.1:1/a"

[[notify.receivers]]
name = "b"
kind = "webhook"
url = "http://127.0.0.1:1/b"

[[notify.receivers]]
name = "c"
kind = "email"
host = "127.0.0.1"
from = "gw@example.com"
to = ["ops@example.com"]
"""


def _notify(routes: str) -> NotifyConfig:
    return parse_config(RECEIVERS + routes).notify


def test_first_match_wins_and_continue_adds_the_next_matches() -> None:
    rules = compile_notify(
        _notify(
            """
[[notify.routes]]
severities = ["CRITICAL"]
receivers = ["a"]
continue = true

[[notify.routes]]
rules = ["hot"]
receivers = ["b"]

[[notify.routes]]
receivers = ["c"]
"""
        )
    )
    critical_hot = Facts(event="alarm.created", device_id="d1", rule_key="hot", severity="CRITICAL")
    # The first route matches and continues; the second matches and stops: c never.
    assert rules.route(critical_hot) == ["a", "b"]
    # Not critical: the first does not match; the second does and stops.
    assert rules.route(Facts(event="alarm.created", rule_key="hot", severity="MAJOR")) == ["b"]
    # Critical, another rule: a, then (continue) the catch-all.
    assert rules.route(Facts(event="alarm.created", rule_key="cold", severity="CRITICAL")) == [
        "a",
        "c",
    ]
    # Nothing matches but the catch-all.
    assert rules.route(Facts(event="command.failed", device_id="d1")) == ["c"]


def test_a_route_without_continue_stops_even_with_no_receivers() -> None:
    rules = compile_notify(
        _notify(
            """
[[notify.routes]]
devices = "lab-*"
receivers = []

[[notify.routes]]
receivers = ["a"]
"""
        )
    )
    assert rules.route(Facts(event="alarm.created", device_id="lab-1")) == []
    assert rules.route(Facts(event="alarm.created", device_id="plant-1")) == ["a"]


def test_matchers_on_events_devices_and_missing_facts() -> None:
    rules = compile_notify(
        _notify(
            """
[[notify.routes]]
events = ["alarm.cleared", "alarm.closed"]
devices = ["door-*", "gate"]
receivers = ["a", "a", "b"]
"""
        )
    )
    assert rules.route(Facts(event="alarm.closed", device_id="door-3")) == ["a", "b"]
    assert rules.route(Facts(event="alarm.closed", device_id="gate")) == ["a", "b"]
    assert rules.route(Facts(event="alarm.closed", device_id="gate-2")) == []
    assert rules.route(Facts(event="alarm.created", device_id="gate")) == []
    # An event with no device does not match a device matcher.
    assert rules.route(Facts(event="alarm.closed")) == []


@pytest.mark.parametrize(
    ("routes", "key"),
    [
        ('[[notify.routes]]\nreceivers = ["nope"]', "notify.routes[0].receivers[0]"),
        (
            '[[notify.routes]]\nevents = ["alarm.open"]\nreceivers = ["a"]',
            "notify.routes[0].events[0]",
        ),
        ('[[notify.routes]]\nevents = []\nreceivers = ["a"]', "notify.routes[0].events"),
        ('[[notify.routes]]\nseverities = ["HIGH"]', "notify.routes[0].severities[0]"),
        ('[[notify.routes]]\nrules = ["bad key"]', "notify.routes[0].rules[0]"),
        ('[[notify.routes]]\ndevices = "bad device!"', "notify.routes[0].devices"),
        ("[[notify.routes]]\ncontinues = true", "notify.routes[0].continues"),
        ("[notify]\nbackoff_min_s = 10.0\nbackoff_max_s = 1.0", "notify.backoff_min_s"),
    ],
)
def test_a_bad_route_is_a_config_error_naming_the_key(routes: str, key: str) -> None:
    # [notify] keys go before the receivers' array of tables.
    text = routes + "\n" + RECEIVERS if routes.startswith("[notify]") else RECEIVERS + routes
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert caught.value.key_path == key, caught.value


_W = 'name = "x"\nkind = "webhook"\nurl = "http://h"\n'
_E = 'name = "x"\nkind = "email"\nhost = "h"\n'


@pytest.mark.parametrize(
    ("receiver", "key"),
    [
        ('name = "x"\nkind = "webhook"\nurl = "ftp://h"', "url"),
        ('name = "x y"\nkind = "webhook"\nurl = "http://h"', "name"),
        (_W + "timeout_s = 90", "timeout_s"),
        (_W + 'secret = "s"\nsecret_env = "E"', "secret_env"),
        (_W + 'headers = { "Bad Name" = "v" }', "headers"),
        ('name = "x"\nkind = "email"\nfrom = "a@b"\nto = ["c@d"]', "host"),
        (_E + 'to = ["c@d"]', "from"),
        (_E + 'from = "a@b"', "to"),
        (_E + 'from = "a@b"\nto = ["nope"]', "to[0]"),
        (_E + 'from = "a@b"\nto = ["c@d"]\ntls = true\nstarttls = true', "starttls"),
        ('name = "x"\nkind = "pager"', "kind"),
    ],
)
def test_a_bad_receiver_is_a_config_error_naming_the_key(receiver: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"[[notify.receivers]]\n{receiver}\n")
    assert caught.value.key_path == f"notify.receivers[0].{key}", caught.value


def test_credentials_in_the_url_and_an_authorization_header_are_refused_together() -> None:
    """The HTTP client would refuse every attempt (it cannot send both); the message names the
    receiver and quotes neither secret."""
    url = 'name = "ops-hook"\nkind = "webhook"\nurl = "https://bob:hunter22@h.example/in"\n'
    for header in ("Authorization", "authorization"):
        with pytest.raises(ConfigError) as caught:
            parse_config(f'[[notify.receivers]]\n{url}headers = {{ {header} = "Bearer t0k3n" }}')
        assert caught.value.key_path == "notify.receivers[0].url"
        assert "'ops-hook'" in str(caught.value)
        assert "hunter22" not in str(caught.value)
        assert "t0k3n" not in str(caught.value)
    # Either one alone is fine.
    assert parse_config(f"[[notify.receivers]]\n{url}").notify.receivers[0].url
    alone = _W + 'headers = { Authorization = "Bearer t0k3n" }'
    assert parse_config(f"[[notify.receivers]]\n{alone}").notify.receivers[0].headers


def test_a_receiver_defined_twice_is_refused() -> None:
    twice = '[[notify.receivers]]\nname = "a"\nkind = "webhook"\nurl = "http://h"\n' * 2
    with pytest.raises(ConfigError) as caught:
        parse_config(twice)
    assert caught.value.key_path == "notify.receivers[1].name"


def test_secrets_come_from_the_environment_and_a_missing_variable_names_the_key(
    tmp_path: object,
) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "c.toml"
    path.write_text(
        '[[notify.receivers]]\nname = "w"\nkind = "webhook"\nurl = "http://h"\n'
        'secret_env = "HOOK_SECRET"\n'
    )
    config = load_config(path, environ={"HOOK_SECRET": "s3cret-value"})
    assert config.notify.receivers[0].secret == "s3cret-value"
    # The resolved configuration compiles again (what build and every reload do).
    assert config.notify_rules().receivers["w"].secret == "s3cret-value"
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert caught.value.key_path == "notify.receivers[0].secret_env"


def test_public_url_is_checked() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config('[http]\npublic_url = "gateway.example.com"\n')
    assert caught.value.key_path == "http.public_url"
    assert parse_config('[http]\npublic_url = "https://gw.example.com/ops"\n').http.public_url


def test_silences_by_rule_by_device_by_severity_and_expiry() -> None:
    def silence(sid: int, ends_in_s: float, **matchers: object) -> object:
        return silence_from_row(
            {
                "id": sid,
                "matchers": msgspec.json.encode(matchers).decode(),
                "ends_at": NOW + timedelta(seconds=ends_in_s),
            }
        )

    by_rule = silence(1, 60, rules=["hot"])
    by_device = silence(2, 60, devices="door-*")
    by_severity = silence(3, 60, severities=["INFO"])
    expired = silence(4, -1)  # matches everything, but is over
    silences = [by_rule, by_device, by_severity, expired]
    hot = Facts(event="alarm.created", device_id="pump", rule_key="hot", severity="MAJOR")
    door = Facts(event="alarm.created", device_id="door-1", rule_key="open", severity="MAJOR")
    info = Facts(event="alarm.created", device_id="pump", rule_key="x", severity="INFO")
    other = Facts(event="alarm.created", device_id="pump", rule_key="x", severity="MAJOR")
    assert first_silence(silences, hot, NOW) is by_rule
    assert first_silence(silences, door, NOW) is by_device
    assert first_silence(silences, info, NOW) is by_severity
    assert first_silence(silences, other, NOW) is None
    # Expiry: at its end a silence no longer silences.
    assert first_silence([by_rule], hot, NOW + timedelta(seconds=60)) is None
    # Everything omitted matches everything (until it ends).
    assert first_silence([silence(5, 1)], other, NOW) is not None


def test_bad_silence_matchers_name_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        compile_matchers(rules=None, devices="x y", severities=None, path="matchers")
    assert caught.value.key_path == "matchers.devices"
    with pytest.raises(ConfigError) as caught:
        compile_matchers(rules=[], devices=None, severities=None, path="matchers")
    assert caught.value.key_path == "matchers.rules"


def test_which_outbox_events_are_notifications() -> None:
    created = notification_of("alarm.created", events.created())
    assert created == Facts(
        event="alarm.created", device_id="d", rule_key="hot", severity="MAJOR", alarm_id=7
    )
    closed = notification_of("alarm.status_changed", events.changed("CLOSED"))
    assert closed is not None
    assert closed.event == "alarm.closed"
    assert notification_of("alarm.status_changed", events.changed("HANDLED")) is None
    samples = events.samples()
    cleared = notification_of("alarm.cleared", samples[EventType.ALARM_CLEARED])
    assert cleared == Facts(event="alarm.cleared", device_id="d", rule_key="hot", alarm_id=7)
    failed = notification_of("command.finished", events.command("TIMEOUT"))
    assert failed == Facts(event="command.failed", device_id="d")
    assert notification_of("command.finished", events.command("ACKED")) is None
    superseded = samples[EventType.ALARM_SUPERSEDED]
    assert notification_of("alarm.superseded", superseded) is None
    aborted = samples[EventType.CAMPAIGN_ABORTED]
    assert notification_of("campaign.aborted", aborted) == Facts(event="campaign.aborted")


def test_link_to_the_console() -> None:
    assert alarm_link("https://gw.example.com/", 12) == "https://gw.example.com/#/alarms/12"
    assert alarm_link("", 12) is None
    assert alarm_link("https://gw.example.com", None) is None


def test_signature_verifies_and_refuses_tampering_and_replay() -> None:
    body = b'{"event":"alarm.created"}'
    header = signature("k", 1_700_000_000, body)
    assert header.startswith("t=1700000000,v1=")
    assert verify_signature("k", header, body, now=1_700_000_010, tolerance_s=300)
    assert not verify_signature("k", header, body + b" ", now=1_700_000_010, tolerance_s=300)
    assert not verify_signature("other", header, body, now=1_700_000_010, tolerance_s=300)
    assert not verify_signature("k", header, body, now=1_700_001_000, tolerance_s=300)
    assert not verify_signature("k", "garbage", body, now=1_700_000_000, tolerance_s=300)


@pytest.mark.parametrize(
    ("routes", "types"),
    [
        ("", set()),
        ('[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["a"]\n', {"alarm.created"}),
        (
            '[[notify.routes]]\nevents = ["command.failed", "alarm.closed"]\nreceivers = ["a"]\n',
            {"command.finished", "alarm.status_changed"},
        ),
        (
            '[[notify.routes]]\nevents = ["campaign.aborted"]\nreceivers = ["a"]\n'
            '[[notify.routes]]\nseverities = ["CRITICAL"]\nreceivers = ["a"]\n',
            {
                "alarm.created", "alarm.escalated", "alarm.reminder", "alarm.cleared",
                "alarm.status_changed", "command.finished", "campaign.aborted",
            },
        ),
    ],
)  # fmt: skip
def test_the_consumer_reads_the_outbox_types_behind_the_routed_events(
    routes: str, types: set[str]
) -> None:
    assert compile_notify(_notify(routes)).outbox_types() == types


_HOT = """
[[notify.routes]]
rules = ["hot"]
devices = "care-*"
receivers = ["a"]
group_by = ["rule", "device"]
repeat_interval_s = 3600
"""
_COLD = _HOT.replace('rules = ["hot"]', 'rules = ["cold"]')
_PLAIN = '\n[[notify.routes]]\nreceivers = ["a", "b"]\n'


def _group_route(routes: str, **group: object) -> int | None:
    compiled = compile_notify(_notify(routes)).routes
    defaults: dict[str, object] = {
        "receiver": "a",
        "group_key": "routes[0]{rule=hot,device=care-1}",
        "labels": {"rule": "hot", "device": "care-1"},
        "identity": None,
    }
    found = route_of_group(compiled, **{**defaults, **group})  # type: ignore[arg-type]
    return None if found is None else found.index


def test_a_stored_group_repeats_for_the_route_of_its_identity_else_the_one_in_its_place() -> None:
    hot = compile_notify(_notify(_HOT)).routes[0].identity
    # The same route moved behind another: found by its identity, wherever it stands.
    assert _group_route(_COLD + _HOT, identity=hot) == 1
    assert _group_route(_COLD + _HOT, identity=hot, group_key="routes[0]{…}|held") == 1
    # Another route in its place, which does not accept the group's labels: none.
    assert _group_route(_COLD, identity=hot) is None
    assert _group_route(_HOT.replace('"care-*"', '"plant-*"'), identity=hot) is None
    # The route edited in place (another identity), still accepting them; a group made
    # before identities were stored, in its place.
    assert _group_route(_HOT.replace('["hot"]', '["hot", "warm"]'), identity=hot) == 0
    assert _group_route(_HOT) == 0
    # Not for this receiver, not grouping, or a key of no route: none.
    assert _group_route(_HOT, receiver="b", identity=hot) is None
    assert _group_route(_PLAIN + _HOT, identity="elsewhere") is None
    assert _group_route(_HOT, group_key="legacy") is None
    # Routes equal in what they match: the first.
    assert _group_route(_HOT + _HOT, identity=hot) == 0


def test_a_routes_identity_is_what_it_matches_and_how_it_groups() -> None:
    def identity(route: str) -> str:
        return compile_notify(_notify(route)).routes[0].identity

    same = [
        _HOT.replace("repeat_interval_s = 3600", "repeat_interval_s = 600"),
        _HOT.replace('receivers = ["a"]', 'receivers = ["a", "b"]'),
        _HOT.replace('rules = ["hot"]', 'rules = ["hot", "hot"]'),
        _HOT + "continue = true\n",
    ]
    assert {identity(r) for r in same} == {identity(_HOT)}
    other = [_COLD, _HOT.replace('group_by = ["rule", "device"]', 'group_by = ["device", "rule"]')]
    assert identity(_HOT) not in {identity(r) for r in other}
