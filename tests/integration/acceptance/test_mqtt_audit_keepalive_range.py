"""`[mqtt] keepalive_s` past what MQTT's two-byte Keep Alive can carry (65,535 s, about 18 h:
someone wanting "a day" writes 86400) passed the file's check. The daemon then started, and
its first CONNECT could not be written: an OverflowError (MQTT 5) or struct.error (3.1.1)
out of the broker session, a traceback instead of a line naming the key. Now the check
refuses it, at check-config, at start (exit 2) and at a reload, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError
from tests.support.daemon import DaemonProcess, config_toml
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_keepalive_mqtt_cannot_carry_is_refused_naming_the_key(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path, protocol: str
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            protocol=protocol,
            mqtt_extra="keepalive_s = 86400",
            log_level="info",
        )
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        process.start()

        def settled() -> bool:
            return not process.alive() or '"daemon_ready"' in process.log_text()

        await wait_until(settled, timeout=60, message="the daemon refused, or ready")
        await wait_until(lambda: not process.alive(), timeout=30, message="the daemon exited")
        log = process.log_text()
        assert process.exit_code() == 2, (
            f"a keepalive_s of 86400 (MQTT carries 65535 at most) was not refused at start:"
            f" exit {process.exit_code()}\n{process.log_tail()}"
        )
        assert "mqtt.keepalive_s" in log, process.log_tail()
        assert "Traceback" not in log, process.log_tail()
    finally:
        process.cleanup()


def test_the_file_check_names_the_key() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(b"[mqtt]\nkeepalive_s = 65536\n")
    assert "mqtt.keepalive_s" in str(refused.value), refused.value
    assert parse_config(b"[mqtt]\nkeepalive_s = 65535\n").mqtt.keepalive_s == 65535
