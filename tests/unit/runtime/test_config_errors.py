"""A configuration is checked whole: every error, each with its key path."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError, ConfigErrors


def _errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    error = caught.value
    return [str(e) for e in error.errors] if isinstance(error, ConfigErrors) else [str(error)]


def test_every_type_error_is_reported_with_its_key_path() -> None:
    assert _errors(
        """
[mqtt]
port = "eighty"
protocol = "4"
typo = 1
[log]
format = "xml"
level = "loud"
[[api.tokens]]
role = "god"
[[rules]]
kind = "event"
"""
    ) == [
        "mqtt.port: Expected `int`, got `str`",
        "mqtt.protocol: Invalid enum value '4'; allowed: '3.1.1', '5'",
        "mqtt.typo: unknown field",
        "log.format: Invalid enum value 'xml'; allowed: 'auto', 'json', 'console'",
        "log.level: Invalid enum value 'loud'; allowed: 'debug', 'info', 'warning', 'error'",
        "api.tokens[0].role: Invalid enum value 'god'; allowed: 'viewer', 'operator', 'admin'",
        "rules[0].key: required field",
        "rules[0].severity: required field",
    ]


def test_nested_and_bounded_values_keep_their_paths() -> None:
    assert _errors('[mqtt.tls]\nenabled = "yes"\n[http]\nport = 70000\n[bogus]\n') == [
        "mqtt.tls.enabled: Expected `bool`, got `str`",
        "http.port: Expected `int` <= 65535",
        "bogus: unknown field",
    ]


def test_every_cross_key_error_is_reported() -> None:
    errors = _errors(
        """
[node]
id = "bad id"
[mqtt]
reconnect_min_s = 100
[database]
pool_min = 20
[[api.tokens]]
token = "short"
[[rules]]
key = "a"
kind = "nope"
severity = "MAJOR"
[[rules]]
key = "b"
kind = "event"
severity = "HUGE"
event = "X"
[ai]
enabled = true
"""
    )
    assert [error.split(":", 1)[0] for error in errors] == [
        "node.id",
        "mqtt.reconnect_min_s",
        "database.pool_min",
        "api.tokens[0].token",
        "api.tokens[0].name",
        "rules[0].kind",
        "rules[1].severity",
        "ai.base_url",
        "ai.model",
    ]


def test_one_error_is_still_a_plain_config_error_with_its_key_path() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("[mqtt]\nport = 0\n")
    assert not isinstance(caught.value, ConfigErrors)
    assert caught.value.key_path == "mqtt.port"


def test_several_errors_read_as_one_line_and_as_the_first_key() -> None:
    with pytest.raises(ConfigErrors) as caught:
        parse_config("[mqtt]\nport = 0\n[log]\nformat = 1\n")
    assert caught.value.key_path == "mqtt.port"
    assert "\n" not in str(caught.value)
    assert "log.format" in str(caught.value)
