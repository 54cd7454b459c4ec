"""A model server refusing the gateway's key may quote it back ("Incorrect API key provided:
sk-...", a proxy's "invalid header Authorization: Bearer sk-..."): the attempt's error is
shown to every viewer (GET /alarms/{id}/summaries), published in the ai.summary_failed event
(MQTT, webhooks) and its raw answer kept for admins. None of them may carry the key, nor the
password of a base_url's userinfo.

The LLM client stored the server's message and body as they came: the key was in
``ai_task.error_message``, ``raw_response`` and the event's payload.
"""

from __future__ import annotations

import json

import asyncpg
import pytest

from gateway.ai.llm import OpenAiCompatibleLlm
from gateway.ai.worker import SummaryWorker
from gateway.alarms.lifecycle import SummarySpec, create_alarm
from gateway.support.metrics import Metrics
from storage import alarms as alarm_repo
from tests.support.fake_llm import FakeLlm

KEY = "sk-live-4f9c2a7e1b3d8a60"
PASSWORD = "llm-pa55word-91"


async def _alarm(pool: asyncpg.Pool) -> int:
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id="door-1", rule_key="door-open", severity="MAJOR",
            telemetry_event_id=f"{1:064x}", reason="DOOR_OPEN", node_id="n1",
            now=await alarm_repo.db_now(conn),
            summary=SummarySpec(model_name="fake-model", prompt_version="v1"),
        )  # fmt: skip
    assert creation.alarm is not None
    return creation.alarm.id


async def _first_attempt(pool: asyncpg.Pool, llm: OpenAiCompatibleLlm) -> str:
    """The alarm's first attempt run against the server; everything stored of it, as text."""
    alarm_id = await _alarm(pool)
    worker = SummaryWorker(pool=pool, llm=llm, node_id="n1", metrics=Metrics(), max_attempts=3)
    assert await worker.run_once()
    row = await pool.fetchrow(
        "SELECT status, error_code, error_message, raw_response FROM ai_task"
        " WHERE alarm_id = $1 AND attempt = 1",
        alarm_id,
    )
    assert row is not None
    assert row["status"] == "FAILED", row
    events = await pool.fetch(
        "SELECT payload::text AS p FROM outbox_event WHERE event_type = 'ai.summary_failed'"
    )
    assert events, "no ai.summary_failed event"
    return json.dumps(
        {"row": dict(row), "events": [e["p"] for e in events]}, default=str, ensure_ascii=False
    )


@pytest.mark.parametrize(
    "answer",
    [
        json.dumps({"error": {"message": f"Incorrect API key provided: {KEY}."}}),
        f"<html><body>401: invalid header Authorization: Bearer {KEY}</body></html>",
        # The message is shown cut to 500 characters: the key across the cut.
        json.dumps({"error": {"message": "x" * 480 + f" key {KEY} is not valid"}}),
    ],
    ids=["json-message", "proxy-page", "key-across-the-cut"],
)
async def test_a_refusal_quoting_the_key_stores_and_publishes_no_key(
    pool: asyncpg.Pool, llm_server: FakeLlm, answer: str
) -> None:
    llm_server.reply_raw(answer, status=401)
    async with OpenAiCompatibleLlm(
        base_url=llm_server.base_url, model="fake-model", api_key=KEY, timeout_s=10
    ) as llm:
        stored = await _first_attempt(pool, llm)
    assert "LLM_HTTP_401" in stored, stored
    assert KEY[:12] not in stored, stored
    assert "[redacted]" in stored, stored


async def test_a_refusal_quoting_the_urls_password_stores_and_publishes_no_password(
    pool: asyncpg.Pool, llm_server: FakeLlm
) -> None:
    llm_server.reply_raw(
        json.dumps({"detail": f"user gateway: password {PASSWORD} is not valid"}), status=401
    )
    base_url = llm_server.base_url.replace("http://", f"http://gateway:{PASSWORD}@")
    async with OpenAiCompatibleLlm(
        base_url=base_url, model="fake-model", api_key=None, timeout_s=10
    ) as llm:
        stored = await _first_attempt(pool, llm)
    assert "LLM_HTTP_401" in stored, stored
    assert PASSWORD not in stored, stored


REST = "Slash-Passw0rd-77"


@pytest.mark.parametrize(
    ("url", "secret", "said"),
    [
        # A key given in the URL's query (``?key=``, as some proxies take it): the client
        # appended ``/chat/completions`` to the query, and every attempt's error quoted the
        # URL with the key.
        pytest.param("{base}?key=" + KEY, KEY, "no query", id="key-in-query"),
        # ``http://aiuser:2024/<rest>@host/v1``: the host part ended at the password's ``/``
        # (host ``aiuser``, port 2024); no userinfo was found to redact, and every attempt's
        # error ("http://aiuser:2024/<rest>@127.0.0.1:.../v1/chat/completions: Cannot connect
        # to host aiuser:2024") quoted the rest of the password.
        pytest.param("http://aiuser:2024/" + REST + "@{host}", REST, "%2F", id="slash-in-password"),
    ],
)
async def test_a_base_url_that_would_quote_its_secret_is_refused(
    pool: asyncpg.Pool, llm_server: FakeLlm, url: str, secret: str, said: str
) -> None:
    """Such a ``base_url`` is refused, without quoting it (the configuration refuses it too,
    naming ``ai.base_url``); were it taken, no attempt's stored error may hold the secret."""
    base_url = url.format(
        base=llm_server.base_url, host=llm_server.base_url.removeprefix("http://")
    )
    refusal = ""
    try:
        llm = OpenAiCompatibleLlm(base_url=base_url, model="fake-model", api_key=None, timeout_s=10)
    except ValueError as refused:
        refusal = str(refused)
    else:
        async with llm:
            stored = await _first_attempt(pool, llm)
        assert secret not in stored, stored
    assert said in refusal, refusal
    assert secret not in refusal, refusal
