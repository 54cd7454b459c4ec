"""The prompt holds the sample that raised the alarm, whatever the device's clock says.

The telemetry in the prompt was "the device's samples dated up to the alarm's triggered_at",
the database's clock at the batch that stored the trigger. A device whose clock runs ahead (a
minute here; anything up to [alarms] max_future_skew_s is taken as device time) dates its
samples after that: the very sample that raised the alarm was left out, and the model was told
"samples: 0" (or shown only older readings) and asked to explain an alarm it could not see.
"""

from __future__ import annotations

import json
import time

import aiomqtt
import asyncpg

from protocol import Topics
from tests.support.daemon import make_config, running_daemon
from tests.support.fake_llm import FakeLlm
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


async def _succeeded(dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return bool(await conn.fetchval("SELECT count(*) FROM ai_task WHERE status = 'SUCCEEDED'"))
    finally:
        await conn.close()


async def test_a_trigger_sample_dated_ahead_of_the_alarm_is_in_the_prompt(
    db_dsn: str, mosquitto: Mosquitto, llm_server: FakeLlm
) -> None:
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        extra=(
            '[[rules]]\nkey = "door-open"\nkind = "event"\nevent = "DOOR_OPEN"\n'
            'severity = "MAJOR"\n'
            f'[ai]\nenabled = true\nbase_url = "{llm_server.base_url}"\nmodel = "fake-model"\n'
        ),
    )  # fmt: skip
    ahead_ms = int(time.time() * 1000) + 60_000  # the device's clock: a minute ahead
    door = {"ts": ahead_ms, "metrics": {"door_angle": 87}, "events": [{"type": "DOOR_OPEN"}]}
    async with running_daemon(config):
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(Topics("iot").telemetry("door-1"), json.dumps(door), qos=1)
        await wait_until(lambda: _succeeded(db_dsn), timeout=30, message="the summary")
    user = llm_server.requests[0]["messages"][1]["content"]
    telemetry = user.split("each sample has")[1]
    assert "samples: 1;" in user, user
    assert '"door_angle":87' in telemetry
