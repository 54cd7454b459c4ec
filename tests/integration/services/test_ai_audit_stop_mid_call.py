"""A node stopped (systemctl stop, a rolling restart) while the model is still answering.

The daemon waited for the call to end, up to ``[ai] timeout_s`` (a slow local model is given a
minute or more), past the unit's TimeoutStopSec=45 that docs/deploying.md promises it exits
within; and the call it waited for was then failed (LLM_TIMEOUT, an attempt spent), or, with
the pool cut by then, left PROCESSING to be swept as WORKER_LOST minutes later. A stop leaves
the call and gives the task back: PENDING, the same attempt, for the next node or start.
"""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg

from gateway.config import Config
from protocol import Topics
from tests.support.daemon import make_config, running_daemon
from tests.support.fake_llm import FakeLlm
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

DOOR = b'{"ts": 1, "events": [{"type": "DOOR_OPEN"}]}'


async def _tasks(dsn: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(
            await conn.fetch(
                "SELECT attempt, status, error_code, claimed_by FROM ai_task ORDER BY attempt"
            )
        )
    finally:
        await conn.close()


def _config(dsn: str, port: int, base_url: str, node: str) -> Config:
    return make_config(
        dsn=dsn, mqtt_port=port, node_id=node,
        extra=(
            '[[rules]]\nkey = "door-open"\nkind = "event"\nevent = "DOOR_OPEN"\n'
            'severity = "MAJOR"\n'
            f'[ai]\nenabled = true\nbase_url = "{base_url}"\nmodel = "fake-model"\n'
            "timeout_s = 50\n"
        ),
    )  # fmt: skip


async def test_a_stop_mid_call_is_prompt_and_gives_the_task_back(
    db_dsn: str, mosquitto: Mosquitto, llm_server: FakeLlm
) -> None:
    loop = asyncio.get_running_loop()
    llm_server.hang()
    async with running_daemon(_config(db_dsn, mosquitto.port, llm_server.base_url, "node-a")):
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(Topics("iot").telemetry("door-1"), DOOR, qos=1)
        await llm_server.wait_for_requests(1, within_s=30)
        stopped_at = loop.time()
    took = loop.time() - stopped_at
    tasks = [(t["attempt"], t["status"], t["error_code"]) for t in await _tasks(db_dsn)]
    assert took < 20, f"the stop took {took:.1f} s (tasks: {tasks})"
    assert tasks == [(1, "PENDING", None)]

    # The next node takes it at once, with no sweep and no attempt spent.
    async with running_daemon(_config(db_dsn, mosquitto.port, llm_server.base_url, "node-b")):

        async def summarised() -> bool:
            return [t["status"] for t in await _tasks(db_dsn)] == ["SUCCEEDED"]

        await wait_until(summarised, timeout=30, message="attempt 1 SUCCEEDED on node-b")
    [task] = await _tasks(db_dsn)
    assert task["claimed_by"] == "node-b"
