"""`inf` (TOML's infinity) or a duration past what a date can hold, in a setting of seconds:
refused by the file's check, at start and at a reload, like any value out of range. It was
accepted (`>= 0` holds for infinity), and the first alarm-timer pass after a reload then ended
the whole daemon on an OverflowError (`now - timedelta(seconds=inf)`); every node reloaded
with the same file went down, and came back only to go down again."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError
from tests.support.daemon import DaemonProcess, config_toml, http_healthy
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until


def _toml(dsn: str, port: int, http_port: int, alarms: str) -> str:
    return config_toml(
        dsn=dsn,
        mqtt_port=port,
        http_port=http_port,
        log_level="info",
        extra=f"[alarms]\ntimer_interval_s = 0.1\n{alarms}\n",
    )


async def test_a_reload_to_an_infinite_escalation_is_refused_and_the_node_lives(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(_toml(db_dsn, mosquitto.port, http_port, "escalate_after_s = 600"))
    process = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        process.start()

        async def healthy() -> bool:
            assert process.alive(), process.log_tail()
            return await http_healthy(http_port)

        await wait_until(healthy, timeout=60, message="daemon healthy")
        config.write_text(_toml(db_dsn, mosquitto.port, http_port, "escalate_after_s = inf"))
        process.signal(signal.SIGHUP)

        def settled() -> bool:
            # Refused, or (before the fix) the daemon gone at its next timer pass, 0.1 s on.
            return not process.alive() or "config_reload_refused" in process.log_text()

        await wait_until(settled, timeout=30, message="the reload refused, or the node dead")
        assert process.alive(), process.log_tail()
        assert "alarms.escalate_after_s" in process.log_text()
        assert await http_healthy(http_port)
        assert process.terminate() == 0
    finally:
        process.cleanup()


@pytest.mark.parametrize(
    "setting",
    [
        "[alarms]\nrepeat_interval_s = inf",
        "[alarms]\nunreached_after_s = 1e15",
        "[commands]\nexpire_after_s = inf",
        "[notify]\npoll_s = inf",
    ],
)
def test_an_infinite_or_boundless_duration_is_refused_naming_the_key(setting: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(setting.encode())
    key = setting.split("\n")[1].split(" ", maxsplit=1)[0]
    assert key in str(refused.value), refused.value
