"""`gateway dead-letters list` prints what devices sent: a dead letter's detail quotes the
payload's keys (`... - at `$.events[0].<key>``), and a key may hold any character JSON can
escape. Printed as is, a device wrote into the operator's terminal: a newline and tabs forged
a listing row of its own, an escape sequence (ESC [ ...) drove the terminal. Control characters
are shown escaped (`\\n`, `\\x1b`); `--json` is unchanged."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiomqtt
import asyncpg

from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

# A key with a newline, tabs and an ANSI escape, under a value the decoder refuses (a NUL).
PAYLOAD = (
    b'{"ts": 1767225600000, "events": [{"type": "DOOR_OPEN", '
    b'"k\\n999\\t2026-01-01T00:00:00+00:00\\tFORGED\\u001b[2J": "a\\u0000b"}]}'
)


async def test_a_listing_shows_the_control_characters_a_device_sent_escaped(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    async with running_daemon(make_config(dsn=db_dsn, mqtt_port=mosquitto.port)):
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as device:
            await device.publish("iot/devices/d1/telemetry", PAYLOAD, qos=1)

        async def dead_lettered() -> bool:
            return bool(await db.fetchval("SELECT count(*) FROM dead_letter") == 1)

        await wait_until(dead_lettered, timeout=30, message="the message dead-lettered")
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{db_dsn}"\n')
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway", "dead-letters", "list", "--config", str(config)],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode().splitlines()
    assert len(lines) == 1, lines  # one letter, one line: no row forged
    assert "\x1b" not in lines[0]
    assert lines[0].count("\t") == 7, lines[0]  # the listing's own columns only
    assert "k\\n999\\t2026-01-01T00:00:00+00:00\\tFORGED\\x1b[2J" in lines[0], lines[0]
