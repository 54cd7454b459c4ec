"""A task written by a newer node, under a prompt version this release does not have (a
rolling upgrade that adds one): this node leaves it to the nodes that know it, and keeps going.

The worker claimed it, looked the version up, and KeyError ended its loop: the daemon's task
group, ingest included, died with it; restarted, it claimed the same task and died again, every
node of the old release in turn, until the upgrade was done.
"""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.alarms.lifecycle import SummarySpec, create_alarm
from storage import alarms as alarm_repo
from tests.support.daemon import make_config, running_daemon
from tests.support.fake_llm import FakeLlm
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


async def _alarm(pool: asyncpg.Pool, n: int, device: str, prompt_version: str) -> int:
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id=device, rule_key="door-open", severity="MAJOR",
            telemetry_event_id=f"{n:064x}", reason="DOOR_OPEN", node_id="newer-node",
            now=await alarm_repo.db_now(conn),
            summary=SummarySpec(model_name="fake-model", prompt_version=prompt_version),
        )  # fmt: skip
    assert creation.alarm is not None
    return creation.alarm.id


async def test_a_task_of_an_unknown_prompt_version_is_left_and_the_node_keeps_going(
    db_dsn: str, pool: asyncpg.Pool, mosquitto: Mosquitto, llm_server: FakeLlm
) -> None:
    newer = await _alarm(pool, 1, "door-1", "v9")  # written by a node of a newer release
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        extra=(
            f'[ai]\nenabled = true\nbase_url = "{llm_server.base_url}"\nmodel = "fake-model"\n'
        ),
    )  # fmt: skip
    async with running_daemon(config):
        [daemon_task] = [t for t in asyncio.all_tasks() if t.get_name() == "daemon-test-node"]
        ours = await _alarm(pool, 2, "door-2", "v1")

        async def done_or_dead() -> bool:
            if daemon_task.done():
                return True
            status = await pool.fetchval("SELECT status FROM ai_task WHERE alarm_id = $1", ours)
            return bool(status == "SUCCEEDED")

        await wait_until(done_or_dead, timeout=30, message="this release's task summarised")
        assert not daemon_task.done(), f"the daemon died: {daemon_task.exception()!r}"
    row = await pool.fetchrow("SELECT status, attempt FROM ai_task WHERE alarm_id = $1", newer)
    assert (row["status"], row["attempt"]) == ("PENDING", 1)  # left for a node that knows v9
