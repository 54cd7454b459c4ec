"""``[mqtt] hosts``: the broker's endpoints, parsed and checked with the rest of the file."""

from __future__ import annotations

import pytest

from gateway.config import broker_endpoints, endpoint_label, parse_config, parse_endpoint
from gateway.domain.errors import ConfigError, ConfigErrors


def _errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    error = caught.value
    return [str(e) for e in error.errors] if isinstance(error, ConfigErrors) else [str(error)]


def test_hosts_are_the_endpoints_in_order_a_missing_port_is_the_port_key() -> None:
    config = parse_config(
        '[mqtt]\nport = 8883\nhosts = ["b1.example:1883", "b2.example", "[::1]:1884",'
        ' "[fe80::1%eth0]", "10.0.0.7:1885"]\n'
    )
    assert broker_endpoints(config.mqtt) == [
        ("b1.example", 1883),
        ("b2.example", 8883),
        ("::1", 1884),
        ("fe80::1%eth0", 8883),
        ("10.0.0.7", 1885),
    ]


def test_host_and_port_stay_one_endpoint_and_nothing_is_the_embedded_broker() -> None:
    assert broker_endpoints(parse_config('[mqtt]\nhost = "broker"\nport = 1999\n').mqtt) == [
        ("broker", 1999)
    ]
    assert broker_endpoints(parse_config("").mqtt) == []
    assert broker_endpoints(parse_config("[mqtt]\nport = 1999\n").mqtt) == []


def test_host_beside_hosts_is_refused_naming_both() -> None:
    assert _errors('[mqtt]\nhost = "a"\nhosts = ["b:1883"]\n') == [
        "mqtt.hosts: set [mqtt] host or [mqtt] hosts, not both (hosts lists every endpoint,"
        " the one of host included)"
    ]


def test_every_bad_entry_is_reported_with_its_index() -> None:
    assert _errors(
        '[mqtt]\nhosts = ["ok:1883", "::1:1883", "a:b", "", "x:70000", "ok:1883", "a b:1"]\n'
    ) == [
        "mqtt.hosts[1]: '::1:1883' is not host:port; write an IPv6 address in brackets: [::1]:1883",
        "mqtt.hosts[2]: 'a:b' is not host:port",
        "mqtt.hosts[3]: '' is not host:port",
        "mqtt.hosts[4]: 'x:70000': the port must be 1 to 65535",
        "mqtt.hosts[5]: 'ok:1883' is mqtt.hosts[0]",
        "mqtt.hosts[6]: 'a b:1' is not host:port",
    ]


def test_a_missing_port_that_equals_a_given_one_is_a_duplicate() -> None:
    assert _errors('[mqtt]\nhosts = ["a", "a:1883"]\n') == [
        "mqtt.hosts[1]: 'a:1883' is mqtt.hosts[0]"
    ]


def test_hosts_must_be_a_list_of_strings() -> None:
    assert _errors('[mqtt]\nhosts = "a:1883"\n') == ["mqtt.hosts: Expected `array`, got `str`"]
    assert _errors("[mqtt]\nhosts = [1883]\n") == ["mqtt.hosts[0]: Expected `str`, got `int`"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[::1]:1883", ("::1", 1883)),
        ("[2001:db8::7]", ("2001:db8::7", 1)),
        ("broker-1.example.net:8883", ("broker-1.example.net", 8883)),
        ("  padded:2  ", ("padded", 2)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text, 1, "k") == expected


@pytest.mark.parametrize("text", ["[::1", "::1]:1", "[]:1", "[broker]:1", "a:0", "a:", "a/b:1"])
def test_parse_endpoint_refuses(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_endpoint(text, 1883, "k")


def test_endpoint_label_brackets_ipv6_only() -> None:
    assert endpoint_label("::1", 1883) == "[::1]:1883"
    assert endpoint_label("broker", 1883) == "broker:1883"
    assert endpoint_label("10.0.0.1", 1) == "10.0.0.1:1"
