"""A task is sent with the model of the server the node calls, not the model the node that
raised the alarm was configured with.

Tasks carried the model name of the node that created them (its [ai] model then), and the
worker sent that name to its own server. After a switch of model (a model retired, a move from
OpenAI to a local Ollama: [ai] model and base_url changed, nodes restarted), every task
created before the restart, and every retry of one (a retry copies its attempt's model), asked
the new server for the old model: `LLM_HTTP_404` "model not found" on each attempt, and the
alarms raised before the switch never got a summary.
"""

from __future__ import annotations

import asyncpg

from gateway.alarms.lifecycle import SummarySpec, create_alarm
from storage import alarms as alarm_repo
from tests.support.daemon import make_config, running_daemon
from tests.support.fake_llm import FakeLlm
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


async def test_a_task_created_before_a_model_switch_asks_the_model_now_configured(
    db_dsn: str, pool: asyncpg.Pool, mosquitto: Mosquitto, llm_server: FakeLlm
) -> None:
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id="door-1", rule_key="door-open", severity="MAJOR",
            telemetry_event_id=f"{1:064x}", reason="DOOR_OPEN", node_id="node-a",
            now=await alarm_repo.db_now(conn),
            # Raised while [ai] model was the old one.
            summary=SummarySpec(model_name="gpt-4o-mini", prompt_version="v1"),
        )  # fmt: skip
    assert creation.alarm is not None
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        extra=f'[ai]\nenabled = true\nbase_url = "{llm_server.base_url}"\nmodel = "llama3.1:8b"\n',
    )  # fmt: skip
    async with running_daemon(config):
        await llm_server.wait_for_requests(1, within_s=30)

        async def finished() -> bool:
            status = await pool.fetchval("SELECT status FROM ai_task WHERE attempt = 1")
            return bool(status in ("SUCCEEDED", "FAILED"))

        await wait_until(finished, timeout=30, message="attempt 1 finished")
    assert llm_server.requests[0]["model"] == "llama3.1:8b"
    stored = await pool.fetchrow("SELECT model_name, request_payload::text FROM ai_task")
    assert stored["model_name"] == "llama3.1:8b"
    assert '"model": "llama3.1:8b"' in stored["request_payload"]
