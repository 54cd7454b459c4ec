"""A reload whose file changes keys read at start only: the operator is told which, by key
(never by value: a password is one of them). Moving the node to another broker by a reload
([mqtt] host, followed) with that broker's credentials ([mqtt] username and password, read at
start) left the node connecting with the old ones, and nothing said the new ones were not in
force: the log said `config_reloaded` only."""

from __future__ import annotations

from structlog.testing import capture_logs

from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto

SECRET = "n3w-br0ker-passw0rd"


async def test_a_reload_names_the_start_only_keys_it_did_not_apply(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    started = make_config(dsn=db_dsn, mqtt_port=mosquitto.port)
    changed = make_config(
        dsn=db_dsn,
        mqtt_port=mosquitto.port,
        mqtt_extra=f'username = "site-b"\npassword = "{SECRET}"',
        extra="[commands]\nlease_s = 45\n[alarms]\nescalate_after_s = 600\n",
    )
    async with running_daemon(started) as daemon:
        with capture_logs() as logs:
            daemon.reload(changed)
            daemon.reload(changed)  # while the file differs from what runs, every reload says so
    warnings = [e for e in logs if e["event"] == "config_change_needs_restart"]
    assert len(warnings) == 2, logs
    assert warnings[0]["keys"] == ["commands.lease_s", "mqtt.password", "mqtt.username"]
    assert SECRET not in repr(logs)
    assert any(e["event"] == "config_reloaded" for e in logs)  # the rest was applied
