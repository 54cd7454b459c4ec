"""The database away for a moment while the model answers: the answer is written once it is
back, as the attempt it answers; it is neither lost nor paid for twice.

The worker called the model holding no connection (as it should), then wrote the result on a
pooled connection; a database blip at that moment (a failover, a restart) lost the answer: the
task stayed PROCESSING until the sweep failed it as WORKER_LOST ("its worker died", which it
had not), and the next attempt called the model again (or, on the last attempt, the alarm
never got its summary).
"""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg
from structlog.testing import capture_logs

from gateway.ai.llm import OpenAiCompatibleLlm
from gateway.ai.worker import SummaryWorker
from gateway.alarms.lifecycle import SummarySpec, create_alarm
from gateway.support.metrics import Metrics
from protocol import Topics
from storage import alarms as alarm_repo
from storage.pool import create_pool
from tests.integration.services.test_ingest_lost_commit import _lose_the_commit_answer
from tests.support.daemon import make_config, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.fake_llm import FakeLlm
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

DOOR = b'{"ts": 1, "events": [{"type": "DOOR_OPEN"}]}'


async def _tasks(dsn: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(
            await conn.fetch("SELECT attempt, status, error_code FROM ai_task ORDER BY attempt")
        )
    finally:
        await conn.close()


async def test_an_answer_arriving_while_the_database_is_away_is_written_when_it_is_back(
    db_dsn: str, mosquitto: Mosquitto, llm_server: FakeLlm
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    config = make_config(
        dsn=through(db_dsn, proxy), mqtt_port=mosquitto.port,
        extra=(
            '[[rules]]\nkey = "door-open"\nkind = "event"\nevent = "DOOR_OPEN"\n'
            'severity = "MAJOR"\n'
            f'[ai]\nenabled = true\nbase_url = "{llm_server.base_url}"\nmodel = "fake-model"\n'
            "timeout_s = 5\nprocessing_timeout_s = 20\n"
        ),
    )  # fmt: skip
    llm_server.hold()
    try:
        with capture_logs() as logs:
            async with running_daemon(config):
                async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
                    await pub.publish(Topics("iot").telemetry("door-1"), DOOR, qos=1)
                await llm_server.wait_for_requests(1, within_s=30)
                await proxy.cut()  # the database goes away while the model thinks ...
                llm_server.release()  # ... and its answer comes back now

                def write_refused() -> bool:
                    return any(
                        line["event"] in {"ai_worker_failed", "ai_result_not_written"}
                        for line in logs
                    )

                await wait_until(write_refused, timeout=30, message="the result write refused")
                await proxy.resume()

                async def settled() -> bool:
                    return any(
                        t["status"] == "SUCCEEDED" or t["error_code"] == "WORKER_LOST"
                        for t in await _tasks(db_dsn)
                    )

                await wait_until(settled, timeout=60, message="attempt 1 settled")
    finally:
        await proxy.cut()
    tasks = [(t["attempt"], t["status"], t["error_code"]) for t in await _tasks(db_dsn)]
    assert tasks == [(1, "SUCCEEDED", None)]
    assert len(llm_server.requests) == 1  # the model was asked once


async def test_a_result_whose_commit_answer_was_lost_counts_once_as_written(
    db_dsn: str, pool: asyncpg.Pool, llm_server: FakeLlm
) -> None:
    """The write's COMMIT reaches PostgreSQL and its answer is lost: the retry finds the
    result this claim wrote (no second event, no 'discarded' count)."""
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id="door-1", rule_key="door-open", severity="MAJOR",
            telemetry_event_id=f"{1:064x}", reason="DOOR_OPEN", node_id="n1",
            now=await alarm_repo.db_now(conn),
            summary=SummarySpec(model_name="fake-model", prompt_version="v1"),
        )  # fmt: skip
    assert creation.alarm is not None
    proxy = proxy_for(db_dsn)
    await proxy.start()
    proxied = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
    async with OpenAiCompatibleLlm(
        base_url=llm_server.base_url, model="fake-model", api_key=None, timeout_s=10
    ) as llm:
        worker = SummaryWorker(
            pool=proxied, llm=llm, node_id="n1", metrics=Metrics(), max_attempts=3
        )
        try:
            claimed = await worker.claim()
            assert claimed is not None
            llm_server.hold()
            processing = asyncio.create_task(worker.process(claimed))
            await llm_server.wait_for_requests(1)
            _lose_the_commit_answer(proxy)
            llm_server.release()

            async def committed() -> bool:
                return bool(await pool.fetchval(
                    "SELECT count(*) FROM ai_task WHERE status = 'SUCCEEDED'"
                ))  # fmt: skip

            await wait_until(committed, timeout=30, message="the result committed")
            proxy.from_client = None
            await proxy.cut()
            proxy.swallowing = False
            await proxy.resume()
            async with asyncio.timeout(60):
                await processing
        finally:
            await proxied.close()
            await proxy.stop()
    registry = worker.metrics.registry
    assert (
        registry.get_sample_value(
            "gateway_ai_tasks_total", {"status": "SUCCEEDED", "error_code": ""}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "gateway_ai_tasks_total", {"status": "DISCARDED", "error_code": ""}
        )
        is None
    )
    events = await pool.fetchval(
        "SELECT count(*) FROM outbox_event WHERE event_type = 'ai.summary_succeeded'"
    )
    assert events == 1
