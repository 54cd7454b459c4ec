from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import (
    ENV_DATABASE_DSN,
    ENV_MQTT_PASSWORD,
    Config,
    load_config,
    parse_config,
)
from gateway.domain.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "config.example.toml"


def test_empty_file_gives_every_default() -> None:
    config = parse_config("")
    assert config == Config()
    assert config.mqtt.host == ""  # embedded broker
    assert config.database.dsn == ""  # embedded PostgreSQL
    assert config.mqtt.protocol == "5"


def test_example_config_decodes_and_documents_every_key() -> None:
    config = load_config(EXAMPLE, environ={})
    assert config.mqtt.topic_prefix == "iot"
    text = EXAMPLE.read_text()
    for section, struct in _sections(Config()):
        for name in struct.__struct_fields__:
            value = getattr(struct, name)
            if hasattr(value, "__struct_fields__") or isinstance(value, list):
                continue
            documented = f"{name} =" in text or f"#   {name} " in text
            assert documented, f"{section}.{name} is not documented"


def _sections(config: Config) -> list[tuple[str, object]]:
    from gateway.config import TokenConfig
    from gateway.domain.rules import RuleConfig

    found: list[tuple[str, object]] = [
        ("api.tokens", TokenConfig()),
        ("rules", RuleConfig(key="k", kind="event", severity="INFO")),
    ]
    for name in config.__struct_fields__:
        section = getattr(config, name)
        if not hasattr(section, "__struct_fields__"):
            continue  # [[rules]]: a list, checked through its element above
        found.append((name, section))
        for sub in section.__struct_fields__:
            value = getattr(section, sub)
            if hasattr(value, "__struct_fields__"):
                found.append((f"{name}.{sub}", value))
    return found


@pytest.mark.parametrize(
    ("text", "key_path", "fragment"),
    [
        ("[mqtt]\nport = 'x'\n", "mqtt.port", "Expected `int`"),
        ("[mqtt]\nport = 70000\n", "mqtt.port", "<= 65535"),
        ("[mqtt]\nportt = 1\n", "mqtt.portt", "unknown field"),
        ("[mqt]\nport = 1\n", "mqt", "unknown field"),
        ("[mqtt.tls]\nenabled = 'yes'\n", "mqtt.tls.enabled", "Expected `bool`"),
        ("[mqtt]\nprotocol = '4'\n", "mqtt.protocol", "Invalid enum value"),
        ("[mqtt]\ntopic_prefix = 'a/#'\n", "mqtt.topic_prefix", "must not contain"),
        ("[mqtt]\nshared_group = 'a/b'\n", "mqtt.shared_group", ""),
        ("[node]\nid = 'no spaces'\n", "node.id", "must match"),
        ("[database]\npool_min = 5\npool_max = 2\n", "database.pool_min", "must not exceed"),
        ("[ingest]\nbatch_max = 0\n", "ingest.batch_max", ">= 1"),
        ("[mqtt\n", "<toml>", ""),
        # [alarms.figures]: thresholds that mean something.
        ("[alarms.figures]\nflood_alarms = 0\n", "alarms.figures.flood_alarms", ">= 1"),
        ("[alarms.figures]\nchatter_raises = 1\n", "alarms.figures.chatter_raises", ">= 2"),
        ("[alarms.figures]\nstale_after_s = 0\n", "alarms.figures.stale_after_s", "> 0"),
        (
            "[alarms.figures]\nchatter_window_s = 120\nchatter_lookback_s = 60\n",
            "alarms.figures.chatter_lookback_s",
            "not be shorter than alarms.figures.chatter_window_s",
        ),
        (
            "[alarms.figures]\nchatter_window_s = 90000\nchatter_lookback_s = 90000\n",
            "alarms.figures.chatter_window_s",
            "at most 86400",
        ),
        # Every token is named (the audit's actor), names are unique.
        ("[[api.tokens]]\ntoken = 'a-token-of-16-chars'\n", "api.tokens[0].name", "required"),
        (
            "[[api.tokens]]\ntoken = 'a-token-of-16-chars'\nname = 'x'\n"
            "[[api.tokens]]\ntoken = 'b-token-of-16-chars'\nname = ''\n",
            "api.tokens[1].name",
            "required",
        ),
        (
            "[[api.tokens]]\ntoken = 'a-token-of-16-chars'\nname = 'olga'\n"
            "[[api.tokens]]\ntoken = 'b-token-of-16-chars'\nname = 'olga'\n",
            "api.tokens[1].name",
            "'olga' is taken already by api.tokens[0]",
        ),
        (
            "[[api.tokens]]\ntoken = 'a-token-of-16-chars'\nname = 'system:rules'\n",
            "api.tokens[0].name",
            "letters, digits",
        ),
    ],
)
def test_errors_name_the_key_path(text: str, key_path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert caught.value.key_path == key_path
    assert fragment.lower() in caught.value.message.lower()
    assert str(caught.value).startswith(f"{key_path}: ")


def test_environment_overrides_secrets(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('[database]\ndsn = "postgresql://file"\n[mqtt]\npassword = "file"\n')
    config = load_config(
        path, environ={ENV_DATABASE_DSN: "postgresql://env", ENV_MQTT_PASSWORD: "s3cret"}
    )
    assert config.database.dsn == "postgresql://env"
    assert config.mqtt.password == "s3cret"
    assert load_config(path, environ={}).database.dsn == "postgresql://file"


def test_systemd_credentials_are_read_when_no_environment_variable(tmp_path: Path) -> None:
    (tmp_path / "mqtt_password").write_text("from-credential\n")
    config = load_config(None, environ={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert config.mqtt.password == "from-credential"


AI = """
[ai]
enabled = true
base_url = "https://llm.example.com/v1"
model = "gpt-4o-mini"
api_key_env = "GW_TEST_OPENAI_KEY"
"""


def test_an_unset_api_key_variable_is_a_configuration_error_naming_the_key(
    tmp_path: Path,
) -> None:
    """At start and on SIGHUP alike (both load the file): a refused reload changes nothing."""
    path = tmp_path / "gateway.toml"
    path.write_text(AI)
    for environ in ({}, {"GW_TEST_OPENAI_KEY": ""}):
        with pytest.raises(ConfigError) as caught:
            load_config(path, environ=environ)
        assert caught.value.key_path == "ai.api_key_env"
        assert "GW_TEST_OPENAI_KEY is not set" in caught.value.message
    # A disabled section sends no key: its variable may be missing.
    path.write_text(AI.replace("enabled = true", "enabled = false"))
    assert load_config(path, environ={}).ai.api_key == ""


def test_the_api_key_is_read_from_its_variable_and_no_log_line_carries_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(AI)
    config = load_config(path, environ={"GW_TEST_OPENAI_KEY": "sk-test-0123456789"})
    assert config.ai.api_key == "sk-test-0123456789"
    assert "sk-test-0123456789" in config.secrets()
    keyed = parse_config(
        AI.replace('api_key_env = "GW_TEST_OPENAI_KEY"', 'api_key = "sk-file-0123"')
    )
    assert "sk-file-0123" in keyed.secrets()


def test_credentials_in_the_ai_base_url_are_secrets_and_exclude_an_api_key() -> None:
    with_userinfo = AI.replace("https://llm", "https://gw:url-pass-0123@llm")
    keyless = parse_config(with_userinfo.replace('api_key_env = "GW_TEST_OPENAI_KEY"', ""))
    assert {"gw:url-pass-0123", "url-pass-0123"} <= set(keyless.secrets())
    # Sent as Basic authentication by the HTTP client, which refuses them beside a key.
    with pytest.raises(ConfigError) as caught:
        parse_config(with_userinfo)
    assert caught.value.key_path == "ai.base_url"
    with pytest.raises(ConfigError) as both:
        parse_config(AI + 'api_key = "sk-file-0123"\n')
    assert both.value.key_path == "ai.api_key"


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "nope.toml", environ={})
    assert caught.value.key_path == "<file>"


def test_batch_size_fits_the_broker_window() -> None:
    config = parse_config("[ingest]\nbatch_max = 500\n[mqtt]\nreceive_maximum = 100\n")
    assert config.batch_size("5") == 50
    assert config.batch_size("3.1.1") == 10  # mosquitto's default window of 20
    assert parse_config("[mqtt]\nbroker_inflight = 1\n").batch_size("3.1.1") == 1
