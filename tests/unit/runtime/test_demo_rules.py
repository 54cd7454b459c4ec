"""The demo's configuration follows the alarm philosophy its docs promise (docs/console.md,
"gateway demo"): noise filtered, CRITICAL only where a person may be in danger, the chattering
rule muted, the demo's webhook receiving the rest; and the file it writes for the other
commands is the same configuration without the token."""

from __future__ import annotations

from pathlib import Path

from gateway.config import parse_config
from gateway.demo.run import RECEIVER_NAME, DemoSettings, demo_config, demo_config_text

URL = "http://127.0.0.1:9/notifications"
TOKEN = "a-demo-token-of-enough-length"


def test_the_demo_rules_are_calm_and_the_chatter_is_muted(tmp_path: Path) -> None:
    config = demo_config(DemoSettings(mqtt_port=1999), tmp_path, TOKEN, URL)
    rules = {rule.key: rule for rule in config.rules}
    severities = {key: rule.severity for key, rule in rules.items()}
    assert {key for key, s in severities.items() if s == "CRITICAL"} == {"sos", "smoke"}
    assert "door-open" not in rules  # doors open all day: stored, not alarmed
    temp = rules["temp-high"]
    assert temp.for_samples is not None
    assert temp.for_samples >= 3
    assert temp.clear_value == 75
    assert temp.severity == "MAJOR"
    # Silence is judged only for the demo's own devices, which report regularly: the native
    # ones, the Tasmota ones (every 10 s) and the Sparkplug edge node's (every 2 s).
    assert rules["silent"].devices == ["demo-*", "tasmota-*", "Demo/Line1/*"]
    # The vendor devices' rules persist and re-arm as temp-high does, for the device they mean.
    for key, device in (("oven-overheat", "Demo/Line1/Oven"), ("room-warm", "tasmota-climate-*")):
        rule = rules[key]
        assert rule.devices == device
        assert rule.for_samples is not None
        assert rule.for_samples >= 3
        assert isinstance(rule.clear_value, int | float)
        assert isinstance(rule.value, int | float)
        assert rule.clear_value < rule.value
        assert rule.severity in ("MAJOR", "WARNING")
    assert config.sparkplug.enabled
    assert config.sparkplug.groups == ["Demo"]
    assert [(m.name, m.profile) for m in config.ingest.mappings] == [("tasmota", "tasmota")]
    for rule in rules.values():
        assert rule.description, rule.key
    (receiver,) = config.notify.receivers
    assert (receiver.name, receiver.kind, receiver.url) == (RECEIVER_NAME, "webhook", URL)
    muted, notified = config.notify.routes
    assert muted.rules == ["fan-vibration"]
    assert muted.receivers == []
    assert notified.receivers == [RECEIVER_NAME]
    assert [token.name for token in config.api.tokens] == ["demo-admin"]


def test_the_file_for_the_other_commands_is_the_same_without_the_token(tmp_path: Path) -> None:
    settings = DemoSettings(http_port=0, mqtt_port=1999)
    written = parse_config(demo_config_text(settings, tmp_path, URL))
    full = demo_config(settings, tmp_path, TOKEN, URL)
    assert written.api.tokens == []
    assert written.state_dir == full.state_dir == tmp_path
    assert written.mqtt.port == full.mqtt.port == 1999
    assert written.rules == full.rules
    assert written.notify == full.notify
