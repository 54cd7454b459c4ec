"""An ``[ai] base_url`` that is no http(s) URL (its scheme forgotten, ``user:password@host/v1``,
or another scheme) is a configuration error naming ``ai.base_url``, never the URL's password.

``gateway check-config`` said the file was ok; ``gateway run`` then started, and died building
the LLM client: a ``daemon_failed`` traceback (exit 1, restarted by the unit for ever) whose
last line was ``ValueError: LLM base_url must be an absolute http(s) URL, got
'aiuser:<password>@llm:8000/v1'``. Without ``://`` Python finds no userinfo in the text, so the
log's redaction did not know the password either: it was in the journal.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

from tests.support.daemon import config_toml
from tests.support.gateway_cli import gateway_run
from tests.support.mosquitto import Mosquitto

PASSWORD: Final = "Llm-Passw0rd-4711"
EXIT_CONFIG: Final = 2


async def _refused_by_check_config(config: Path) -> None:
    """``gateway check-config`` refuses ``config``, naming ``ai.base_url``, not its password."""
    checked = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway", "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == EXIT_CONFIG, checked
    assert "ai.base_url" in checked.stderr, checked
    assert PASSWORD not in checked.stdout + checked.stderr, checked


@pytest.mark.parametrize(
    "base_url",
    [
        f"aiuser:{PASSWORD}@127.0.0.1:9/v1",  # the scheme forgotten
        f"ftp://aiuser:{PASSWORD}@127.0.0.1:9/v1",
        f"http://aiuser:2024/{PASSWORD}@127.0.0.1:9/v1",  # a '/' in the password
    ],
    ids=["no-scheme", "ftp", "slash-in-password"],
)
async def test_a_base_url_that_is_no_http_url_is_a_configuration_error_without_its_password(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path, base_url: str
) -> None:
    config = tmp_path / "gateway.toml"
    ai = f'[ai]\nenabled = true\nbase_url = "{base_url}"\nmodel = "m"\n'
    config.write_text(config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, extra=ai))

    done = await gateway_run(config)
    assert PASSWORD not in done.output, done.output
    done.assert_no_traceback()
    assert done.returncode == EXIT_CONFIG, done.output
    line = done.the("config_invalid")
    assert line["setting"] == "ai.base_url", line

    await _refused_by_check_config(config)


async def test_a_base_url_with_a_query_is_a_configuration_error_without_its_key(
    tmp_path: Path,
) -> None:
    """``?key=`` (as some proxies take a key): the client appended ``/chat/completions`` to
    the query, and every attempt's error, stored, published and logged, quoted the key."""
    config = tmp_path / "gateway.toml"
    ai = f'[ai]\nenabled = true\nbase_url = "http://127.0.0.1:9/v1?key={PASSWORD}"\nmodel = "m"\n'
    config.write_text(config_toml(dsn="postgresql://gw@127.0.0.1:9/gw", mqtt_port=9, extra=ai))
    await _refused_by_check_config(config)
