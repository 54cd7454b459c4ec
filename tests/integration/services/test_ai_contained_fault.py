"""A fault of the gateway's own AI code on one task (a bug met by one alarm's prompt, or by one
model answer) fails that task, with its traceback in the log, and the worker goes on; it is
never the daemon's end. The AI loop let anything but a database error through: the daemon
stopped, every device's ingest with it, and (the claim rolled back, the task still due) the
same task ended it again at every restart, a crash loop over a feature people may switch off.
The bug is put in by hand here (no input is known to reach one today)."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from gateway.ai import worker as worker_module
from gateway.ai.llm import OpenAiCompatibleLlm
from gateway.ai.worker import SummaryWorker
from gateway.support.metrics import Metrics
from tests.integration.services.test_ai_audit_retry_after import _alarm
from tests.support.fake_llm import DEFAULT_CONTENT, FakeLlm


def _bug(*_args: Any, **_kwargs: Any) -> Any:
    raise KeyError("a bug in the gateway's own code")


async def _attempts(pool: asyncpg.Pool, alarm_id: int) -> list[asyncpg.Record]:
    return list(
        await pool.fetch(
            "SELECT attempt, status, error_code, error_message FROM ai_task"
            " WHERE alarm_id = $1 ORDER BY attempt",
            alarm_id,
        )
    )


@pytest.mark.parametrize("where", ["build_request", "parse_summary"])
async def test_a_bug_met_by_one_task_fails_that_task_and_the_worker_goes_on(
    pool: asyncpg.Pool, llm_server: FakeLlm, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    alarm_id = await _alarm(pool)
    llm_server.reply(DEFAULT_CONTENT)
    monkeypatch.setattr(worker_module, where, _bug)
    async with OpenAiCompatibleLlm(
        base_url=llm_server.base_url, model="fake-model", api_key=None, timeout_s=10
    ) as llm:
        worker = SummaryWorker(pool=pool, llm=llm, node_id="n1", metrics=Metrics(), max_attempts=2)
        assert await worker.run_once(), "the task was not taken"
        first, second = await _attempts(pool, alarm_id)
        assert (first["status"], first["error_code"]) == ("FAILED", "WORKER_FAILED")
        assert "KeyError" in first["error_message"]
        assert (second["attempt"], second["status"]) == (2, "PENDING")
        # The bug fixed (the node upgraded): the next attempt is a summary.
        monkeypatch.undo()
        llm_server.reply(DEFAULT_CONTENT)
        await pool.execute("UPDATE ai_task SET next_attempt_at = now() WHERE status = 'PENDING'")
        assert await worker.run_once()
    assert [r["status"] for r in await _attempts(pool, alarm_id)] == ["FAILED", "SUCCEEDED"]
