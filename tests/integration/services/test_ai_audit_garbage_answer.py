"""A garbage answer from the LLM's server fails the task; it never takes the gateway down.

A body nested deeper than Python's recursion limit (a broken proxy, a hostile server) made the
JSON decoder raise RecursionError, which no handler caught: the AI worker's loop ended, and with
it the daemon's task group, ingest included.
"""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg
import pytest

from gateway.ai.llm import LlmError, OpenAiCompatibleLlm
from protocol import Topics
from tests.support.daemon import make_config, running_daemon
from tests.support.fake_llm import FakeLlm
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

DEEP = "[" * 200_000  # 200 kB: far below the client's 8 MiB bound, far past the recursion limit


async def _tasks(dsn: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(
            await conn.fetch("SELECT attempt, status, error_code, raw_response FROM ai_task")
        )
    finally:
        await conn.close()


@pytest.mark.parametrize("status", [200, 500], ids=["answer", "error-body"])
async def test_a_deeply_nested_body_fails_the_task_and_the_daemon_keeps_running(
    db_dsn: str, mosquitto: Mosquitto, llm_server: FakeLlm, status: int
) -> None:
    llm_server.reply_raw(DEEP, status=status)
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        extra=(
            '[[rules]]\nkey = "door-open"\nkind = "event"\nevent = "DOOR_OPEN"\n'
            'severity = "MAJOR"\n'
            f'[ai]\nenabled = true\nbase_url = "{llm_server.base_url}"\nmodel = "fake-model"\n'
            "max_attempts = 1\n"
        ),
    )  # fmt: skip
    async with running_daemon(config):
        [daemon_task] = [t for t in asyncio.all_tasks() if t.get_name() == "daemon-test-node"]

        async def finished_or_dead() -> bool:
            if daemon_task.done():
                return True
            return any(t["status"] == "FAILED" for t in await _tasks(db_dsn))

        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            door = b'{"ts": 1, "events": [{"type": "DOOR_OPEN"}]}'
            await pub.publish(Topics("iot").telemetry("door-1"), door, qos=1)
        await wait_until(finished_or_dead, timeout=30, message="the task FAILED")
        assert not daemon_task.done(), f"the daemon died: {daemon_task.exception()!r}"
        [task] = await _tasks(db_dsn)
        expected = "LLM_PROTOCOL" if status == 200 else "LLM_HTTP_500"
        assert (task["status"], task["error_code"]) == ("FAILED", expected)
        assert task["raw_response"].startswith("[[[[")
        # ... and the node still ingests.
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(Topics("iot").telemetry("door-2"), door, qos=1)
        await wait_until(lambda: _count(db_dsn), timeout=30, message="a second task")


async def _count(dsn: str) -> bool:
    return len(await _tasks(dsn)) == 2


@pytest.mark.parametrize(
    "location", ["ftp://gw:pw-0123@files.example/x", "http://[bad"], ids=["not-http", "not-a-url"]
)
async def test_a_redirect_the_client_cannot_follow_is_a_protocol_error(
    llm_server: FakeLlm, location: str
) -> None:
    """A proxy redirecting the call somewhere aiohttp will not go raised its own error class,
    which no handler caught either."""
    llm_server.reply_raw("", status=307, headers={"Location": location})
    async with OpenAiCompatibleLlm(
        base_url=llm_server.base_url, model="fake-model", api_key=None, timeout_s=10
    ) as llm:
        with pytest.raises(LlmError) as caught:
            await llm.complete({"messages": [{"role": "user", "content": "hi"}]})
    assert caught.value.code == "LLM_PROTOCOL"
    assert "pw-0123" not in caught.value.message
