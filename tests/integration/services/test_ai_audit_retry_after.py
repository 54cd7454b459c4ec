"""A model server that is rate limiting says when to come back (429 or 503 with Retry-After):
the next attempt waits at least that long.

The worker retried after its own backoff only (15-30 s after the first attempt, 30-60 s after
the second), so against a server asking for a minute or more every attempt of the alarm was
spent inside the rate limit, and the alarm ended FAILED LLM_HTTP_429 with no summary.
"""

from __future__ import annotations

import email.utils
import time

import asyncpg
import pytest

from gateway.ai.llm import OpenAiCompatibleLlm
from gateway.ai.worker import SummaryWorker
from gateway.alarms.lifecycle import SummarySpec, create_alarm
from gateway.support.metrics import Metrics
from storage import alarms as alarm_repo
from tests.support.fake_llm import FakeLlm

LIMITED = '{"error": {"message": "Rate limit reached", "type": "rate_limit_error"}}'


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


@pytest.mark.parametrize(
    ("status", "retry_after"),
    [
        (429, "600"),
        (503, "date"),  # an HTTP date 600 s from the test's start
    ],
    ids=["429-seconds", "503-http-date"],
)
async def test_the_next_attempt_waits_for_the_servers_retry_after(
    pool: asyncpg.Pool, llm_server: FakeLlm, status: int, retry_after: str
) -> None:
    if retry_after == "date":
        retry_after = email.utils.formatdate(time.time() + 600, usegmt=True)
    alarm_id = await _alarm(pool)
    llm_server.reply_raw(LIMITED, status=status, headers={"Retry-After": retry_after})
    async with OpenAiCompatibleLlm(
        base_url=llm_server.base_url, model="fake-model", api_key=None, timeout_s=10
    ) as llm:
        worker = SummaryWorker(pool=pool, llm=llm, node_id="n1", metrics=Metrics(), max_attempts=3)
        assert await worker.run_once()
    rows = await pool.fetch(
        "SELECT attempt, status, error_code, finished_at, next_attempt_at FROM ai_task"
        " WHERE alarm_id = $1 ORDER BY attempt",
        alarm_id,
    )
    first, second = rows
    assert (first["status"], first["error_code"]) == ("FAILED", f"LLM_HTTP_{status}")
    assert (second["attempt"], second["status"]) == (2, "PENDING")
    wait = (second["next_attempt_at"] - first["finished_at"]).total_seconds()
    # An HTTP date has whole seconds: a second of slack below the 600 asked for.
    assert wait >= 599, f"attempt 2 is due {wait:.0f} s after attempt 1, Retry-After said 600"


@pytest.mark.parametrize("header", ["\u00b2", "soon", "-5", "1.5"])
async def test_an_unreadable_retry_after_is_ignored(
    pool: asyncpg.Pool, llm_server: FakeLlm, header: str
) -> None:
    """Not a number of seconds nor an HTTP date: the usual backoff, and no crash (a "²",
    which str.isdigit() takes, made float() raise out of the client)."""
    alarm_id = await _alarm(pool)
    llm_server.reply_raw(LIMITED, status=429, headers={"Retry-After": header})
    async with OpenAiCompatibleLlm(
        base_url=llm_server.base_url, model="fake-model", api_key=None, timeout_s=10
    ) as llm:
        worker = SummaryWorker(pool=pool, llm=llm, node_id="n1", metrics=Metrics(), max_attempts=3)
        assert await worker.run_once()
    statuses = await pool.fetch(
        "SELECT status, error_code FROM ai_task WHERE alarm_id = $1 ORDER BY attempt", alarm_id
    )
    assert [(r["status"], r["error_code"]) for r in statuses] == [
        ("FAILED", "LLM_HTTP_429"),
        ("PENDING", None),
    ]
