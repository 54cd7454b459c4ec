"""An AI summary task that waits longer than ``[retention] outbox_days`` still tells the model
why the alarm fired.

The worker read the alarm's reason from its ``alarm.created`` outbox event, which retention
prunes once published and ``outbox_days`` old (7 by default): a task still due after that (a
model server down for a week, a backlog, attempts spaced by a long Retry-After, an alarm
created by a late sample, for which no summary is asked at once) built its prompt with
``"reason": null``. The reason is kept with the alarm now (migration 0058).

Real PostgreSQL, the real maintenance pass, the real worker and HTTP client against a fake
model server (tests/support/fake_llm.py).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import asyncpg

from gateway.ai.llm import OpenAiCompatibleLlm
from gateway.ai.worker import SummaryWorker
from gateway.alarms.lifecycle import (
    AlarmRequest,
    SummarySpec,
    create_alarm,
    create_alarms,
    create_late_alarm,
)
from gateway.config import RetentionConfig
from gateway.maintenance.runner import Maintenance
from gateway.support.metrics import Metrics
from storage import ai_tasks as ai_repo
from storage import alarms as alarm_repo
from tests.support.fake_llm import DEFAULT_SUMMARY, FakeLlm

SPEC = SummarySpec(model_name="fake-model", prompt_version="v1")


async def _alarms(pool: asyncpg.Pool) -> dict[int, str]:
    """Alarms by each way one is created (one, a batch, a late one), each with a pending task;
    their ids and reasons."""
    reasons: dict[int, str] = {}
    async with pool.acquire() as conn, conn.transaction():
        now = await alarm_repo.db_now(conn)
        one = await create_alarm(
            conn, device_id="door-1", rule_key="door-open", severity="MAJOR",
            telemetry_event_id=f"{1:064x}", reason="door open for 95 s (limit 60 s)",
            node_id="n1", now=now, summary=SPEC,
        )  # fmt: skip
        assert one.alarm is not None
        reasons[one.alarm.id] = "door open for 95 s (limit 60 s)"
        (batch,) = await create_alarms(
            conn,
            [AlarmRequest(device_id="tank-1", rule_key="level-high", severity="WARNING",
                          telemetry_event_id=f"{2:064x}", reason="level 97 % > 90 %")],
            node_id="n1", now=now, summary=SPEC,
        )  # fmt: skip
        assert batch.alarm is not None
        reasons[batch.alarm.id] = "level 97 % > 90 %"
        newer = await create_alarm(
            conn, device_id="pump-1", rule_key="overheat", severity="CRITICAL",
            telemetry_event_id=f"{4:064x}", reason="temperature 91 C > 85 C",
            node_id="n1", now=now,
        )  # fmt: skip
        assert newer.alarm is not None
        late = await create_late_alarm(
            conn,
            AlarmRequest(device_id="pump-1", rule_key="overheat", severity="CRITICAL",
                         telemetry_event_id=f"{3:064x}", reason="temperature 88 C > 85 C"),
            superseded_by_event=f"{4:064x}", cleared_by_event=None, node_id="n1", now=now,
        )  # fmt: skip
        assert late.alarm is not None
        # A late alarm gets no summary at once; one asked for later (as the API does).
        await ai_repo.insert_task(
            conn, alarm_id=late.alarm.id, attempt=1, model_name="fake-model", prompt_version="v1"
        )
        reasons[late.alarm.id] = "temperature 88 C > 85 C"
    return reasons


async def _prune_published_events(pool: asyncpg.Pool, days_later: int) -> int:
    """Publish every event (as the outbox publisher does) and run a maintenance pass
    ``days_later`` days on; how many events it pruned."""
    now: datetime = await pool.fetchval(
        "UPDATE outbox_event SET status = 'PUBLISHED', published_at = now() RETURNING now()"
    )
    pass_now = now + timedelta(days=days_later)
    maintenance = Maintenance(
        pool=pool,
        retention=RetentionConfig(telemetry_days=0, outbox_days=7),
        metrics=Metrics(),
        db_clock=lambda: pass_now,
    )
    report = await maintenance.run_once()
    assert report.ran
    return report.deleted["outbox_event"]


async def test_a_task_due_after_its_creation_event_was_pruned_still_gets_the_reason(
    pool: asyncpg.Pool, llm_server: FakeLlm
) -> None:
    reasons = await _alarms(pool)
    assert await _prune_published_events(pool, days_later=8) > 0
    left = "SELECT count(*) FROM outbox_event WHERE event_type = 'alarm.created'"
    assert await pool.fetchval(left) == 0
    llm_server.reply(json.dumps(DEFAULT_SUMMARY))
    async with OpenAiCompatibleLlm(
        base_url=llm_server.base_url, model="fake-model", api_key=None, timeout_s=10
    ) as llm:
        worker = SummaryWorker(pool=pool, llm=llm, node_id="n1", metrics=Metrics(), max_attempts=3)
        for _ in reasons:
            assert await worker.run_once()
    # What the model was told: the user message's first line after its heading, the facts.
    told = {}
    for body in llm_server.requests:
        facts = json.loads(body["messages"][-1]["content"].splitlines()[1])
        told[facts["alarm_id"]] = facts["reason"]
    assert told == reasons


async def test_an_alarm_created_before_the_reason_was_kept_reads_it_from_its_event(
    pool: asyncpg.Pool,
) -> None:
    """An alarm of a release before migration 0058 (no reason on its row): its creation
    event's reason while that event is kept, None once it is pruned (no worse than before)."""
    (alarm_id,) = list(await _alarms(pool))[:1]
    await pool.execute("UPDATE alarm SET reason = NULL WHERE id = $1", alarm_id)
    async with pool.acquire() as conn:
        assert await ai_repo.alarm_reason(conn, alarm_id) == "door open for 95 s (limit 60 s)"
    await _prune_published_events(pool, days_later=8)
    async with pool.acquire() as conn:
        assert await ai_repo.alarm_reason(conn, alarm_id) is None
