"""An API key variable ending in a newline (a Kubernetes secret made with --from-file, a key
file read into the environment as is) authenticates with the key; it does not kill the node.

aiohttp refuses a header holding a control character with a ValueError, which the LLM client
did not catch: the first alarm's summary call ended the AI worker's loop and the daemon with it
(ingest, alarms, API), and every restart died again at the next call.
"""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg
import pytest

from gateway.config import apply_secrets
from gateway.domain.errors import ConfigError
from protocol import Topics
from tests.support.daemon import make_config, running_daemon
from tests.support.fake_llm import FakeLlm
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

AI = '[ai]\nenabled = true\nbase_url = "{url}"\nmodel = "fake-model"\n'
RULE = '[[rules]]\nkey = "door-open"\nkind = "event"\nevent = "DOOR_OPEN"\nseverity = "MAJOR"\n'


async def test_a_key_variable_ending_in_a_newline_authenticates_with_the_key(
    db_dsn: str, mosquitto: Mosquitto, llm_server: FakeLlm
) -> None:
    config = apply_secrets(
        make_config(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            extra=RULE + AI.format(url=llm_server.base_url) + 'api_key_env = "GW_AI_KEY"\n',
        ),
        {"GW_AI_KEY": "sk-live-0123\n"},
    )
    async with running_daemon(config):
        [daemon_task] = [t for t in asyncio.all_tasks() if t.get_name() == "daemon-test-node"]

        async def done_or_dead() -> bool:
            if daemon_task.done():
                return True
            conn = await asyncpg.connect(db_dsn)
            try:
                return bool(
                    await conn.fetchval(
                        "SELECT count(*) FROM ai_task WHERE status IN ('SUCCEEDED', 'FAILED')"
                    )
                )
            finally:
                await conn.close()

        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            door = b'{"ts": 1, "events": [{"type": "DOOR_OPEN"}]}'
            await pub.publish(Topics("iot").telemetry("door-1"), door, qos=1)
        await wait_until(done_or_dead, timeout=30, message="the task finished")
        assert not daemon_task.done(), f"the daemon died: {daemon_task.exception()!r}"
    assert llm_server.headers[0]["Authorization"] == "Bearer sk-live-0123"


def test_a_key_with_a_control_character_inside_is_a_configuration_error() -> None:
    text = AI.format(url="http://127.0.0.1:1/v1")
    with pytest.raises(ConfigError) as caught:
        apply_secrets(
            make_config(dsn="postgresql://x@h/d", mqtt_port=1, extra=text + 'api_key_env = "K"\n'),
            {"K": "sk-a\r\nX-Injected: 1"},
        )
    assert "ai.api_key_env" in str(caught.value)
    assert "X-Injected" not in str(caught.value)  # never the value
    with pytest.raises(ConfigError) as caught:
        make_config(dsn="postgresql://x@h/d", mqtt_port=1, extra=text + 'api_key = "sk-a\\nbc"\n')
    assert "ai.api_key" in str(caught.value)
