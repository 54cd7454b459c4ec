"""A webhook URL no request can be made to (an unclosed IPv6 bracket, a port that is no port,
no host) is a configuration error naming the key: refused by ``gateway check-config``, at
start and on SIGHUP (which keeps the running configuration), never a crash nor a receiver
whose every delivery fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError

UNSENDABLE = [
    "http://[::1/hook",  # an IPv6 address never closed
    "http://127.0.0.1:99999/hook",  # no such port
    "http://127.0.0.1:8o80/hook",  # a typo for 8080
    "http://hooks.example.com:80:80/hook",
    "https://:8443/hook",  # no host
    "https://bob:hunter22@/hook",  # credentials, and no host
]


def _receiver(url: str) -> str:
    return f'[[notify.receivers]]\nname = "ops"\nkind = "webhook"\nurl = "{url}"\n'


@pytest.mark.parametrize("url", UNSENDABLE)
def test_a_webhook_url_no_request_can_be_made_to_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(_receiver(url))
    assert caught.value.key_path == "notify.receivers[0].url", caught.value
    assert "hunter22" not in str(caught.value)


def test_check_config_lists_it_rather_than_failing_with_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(_receiver("http://[::1/hook"))
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "notify.receivers[0].url" in result.stderr
    assert "Traceback" not in result.stderr


def test_ordinary_webhook_urls_are_still_accepted() -> None:
    for url in (
        "http://127.0.0.1:8080/hook",
        "https://hooks.example.com/services/T0/B0/x?token=abc",
        "http://[::1]:8080/hook",
        "https://bob:hunter22@hooks.example.com/in",
        "http://h",
    ):
        assert parse_config(_receiver(url)).notify.receivers[0].url == url
