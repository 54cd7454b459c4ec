"""Audit: configuration.md, "Reloading", names every key a reload applies.

An operator reads that section to know whether `systemctl reload gateway` is enough: it ends
"Other keys are read at start: change them with a restart". `[alarms.figures]`, applied by a
reload (config.example.toml says so, and the daemon does), was missing from it, so the section
told an operator to restart a node for a change a reload makes.

The phrase each key of gateway.runtime.daemon.RELOADED goes by in that section: a key added to
RELOADED without a phrase here fails, and so does a phrase the section lacks.
"""

from __future__ import annotations

from pathlib import Path

from gateway.runtime.daemon import RELOADED

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"

PHRASES: dict[str, str] = {
    "rules": "the rules",
    "api": "the API tokens",
    "notify": "whole `[notify]` section",
    "retention": "whole `[retention]` section",
    "ingest.mappings": "`[[ingest.mappings]]`",
    "alarms.escalate_after_s": "`[alarms] escalate_after_s`",
    "alarms.repeat_interval_s": "`repeat_interval_s`",
    "alarms.unreached_after_s": "`unreached_after_s`",
    "alarms.rule_check_after_s": "`rule_check_after_s`",
    "alarms.max_future_skew_s": "`max_future_skew_s`",
    "alarms.reorder_window_s": "`reorder_window_s`",
    "alarms.quiet_hours": "the quiet hours",
    "alarms.figures": "`[alarms.figures]`",
    "http.public_url": "`[http] public_url`",
    "http.max_streams": "`max_streams`",
    "http.max_streams_per_token": "`max_streams_per_token`",
    "mqtt.topic_prefix": "`[mqtt] topic_prefix`",
    "mqtt.shared_group": "`shared_group`",
    "mqtt.hosts": "`[mqtt] hosts`",
    "mqtt.host": "`host`",
    "mqtt.port": "`port`",
    "mqtt.protocol": "`[mqtt] protocol`",
    "sparkplug": "`[sparkplug]`",
}


def _reloading_section() -> str:
    text = DOC.read_text()
    start = text.index("## Reloading")
    end = text.find("\n## ", start + 1)
    return " ".join(text[start : None if end < 0 else end].split())


def test_every_reloaded_key_has_its_phrase() -> None:
    assert set(RELOADED) == set(PHRASES)


def test_the_reloading_section_names_every_key_a_reload_applies() -> None:
    section = _reloading_section()
    missing = [key for key, phrase in PHRASES.items() if phrase not in section]
    assert not missing, f"docs/configuration.md, Reloading, does not name {missing}"
