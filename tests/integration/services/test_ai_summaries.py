"""AI summaries against a real OpenAI-compatible server on loopback, scripted per test."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import aiomqtt
import asyncpg
import msgspec
import pytest
from structlog.testing import capture_logs

from gateway.ai.llm import OpenAiCompatibleLlm
from gateway.ai.worker import SummaryWorker
from gateway.alarms.lifecycle import SummarySpec, create_alarm
from gateway.support.metrics import Metrics
from protocol import Topics
from sim.publisher import publish_many
from storage import ai_tasks as ai_repo
from storage import alarms as alarm_repo
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.fake_llm import DEFAULT_SUMMARY, FakeLlm
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

SPEC = SummarySpec(model_name="fake-model", prompt_version="v1")


# The clients _worker made, closed after each test: a session left to the collector warns
# from wherever the collection runs (once, inside the compiler, failing the whole session).
_CLIENTS: list[OpenAiCompatibleLlm] = []


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _CLIENTS:
        await _CLIENTS.pop().close()


def _worker(
    pool: asyncpg.Pool, server: FakeLlm, *, timeout_s: float = 5.0, **kw: object
) -> SummaryWorker:
    llm = OpenAiCompatibleLlm(base_url=server.base_url, model="fake-model", api_key=None,
                              timeout_s=timeout_s)  # fmt: skip
    _CLIENTS.append(llm)
    return SummaryWorker(pool=pool, llm=llm, node_id="n1", metrics=Metrics(), max_attempts=3,
                         **kw)  # type: ignore[arg-type]  # fmt: skip


async def _alarm(pool: asyncpg.Pool, n: int = 0, device: str = "door-1") -> int:
    async with pool.acquire() as conn, conn.transaction():
        creation = await create_alarm(
            conn, device_id=device, rule_key="door-open", severity="MAJOR",
            telemetry_event_id=f"{n:064x}", reason="DOOR_OPEN", node_id="n1",
            now=await alarm_repo.db_now(conn), summary=SPEC,
        )  # fmt: skip
    assert creation.alarm is not None
    return creation.alarm.id


async def _task(pool: asyncpg.Pool, alarm_id: int) -> asyncpg.Record:
    async with pool.acquire() as conn:
        row = await ai_repo.latest_for_alarm(conn, alarm_id)
    assert row is not None
    return row


async def test_a_clean_answer_succeeds_with_every_field_archived(
    pool: asyncpg.Pool, llm_server: FakeLlm
) -> None:
    alarm_id = await _alarm(pool)
    assert await _worker(pool, llm_server).run_once()
    task = await _task(pool, alarm_id)
    assert task["status"] == "SUCCEEDED"
    for field in ("summary", "possible_cause", "inspection_suggestion", "risk_level"):
        assert task[field] == DEFAULT_SUMMARY[field]
    assert task["confidence"] == DEFAULT_SUMMARY["confidence"]
    assert (task["model_name"], task["prompt_version"]) == ("fake-model", "v1")
    request = msgspec.json.decode(task["request_payload"])
    assert request["messages"][0]["role"] == "system"
    assert "door-1" in request["messages"][1]["content"]
    assert "DOOR_OPEN" in request["messages"][1]["content"]  # the reason, from alarm.created
    assert llm_server.requests[0]["messages"] == request["messages"]
    assert msgspec.json.decode(task["raw_response"])["choices"]
    assert task["finished_at"] >= task["started_at"]


async def test_a_fenced_answer_is_parsed(pool: asyncpg.Pool, llm_server: FakeLlm) -> None:
    alarm_id = await _alarm(pool)
    llm_server.reply("```json\n" + msgspec.json.encode(DEFAULT_SUMMARY).decode() + "\n```")
    await _worker(pool, llm_server).run_once()
    assert (await _task(pool, alarm_id))["status"] == "SUCCEEDED"


@pytest.mark.parametrize(
    "content",
    [
        "The door is open, probably someone forgot it.",
        msgspec.json.encode({**DEFAULT_SUMMARY, "risk_level": "SEVERE"}).decode(),
        msgspec.json.encode({**DEFAULT_SUMMARY, "confidence": 1.7}).decode(),
        msgspec.json.encode({k: v for k, v in DEFAULT_SUMMARY.items() if k != "summary"}).decode(),
    ],
    ids=["prose", "wrong-enum", "confidence-1.7", "missing-field"],
)
async def test_invalid_output_fails_with_the_raw_response_kept(
    pool: asyncpg.Pool, llm_server: FakeLlm, content: str
) -> None:
    alarm_id = await _alarm(pool)
    llm_server.reply(content)
    await _worker(pool, llm_server).run_once()
    first = (await ai_repo_for(pool, alarm_id))[0]
    assert (first["status"], first["error_code"]) == ("FAILED", "LLM_OUTPUT_INVALID")
    archived = msgspec.json.decode(first["raw_response"])  # the whole body as received
    assert archived["choices"][0]["message"]["content"] == content
    assert first["error_message"]
    # A failure is a fact: an event, and a new attempt later.
    retry = await _task(pool, alarm_id)
    assert (retry["attempt"], retry["status"]) == (2, "PENDING")
    async with pool.acquire() as conn:
        events = await conn.fetchval(
            "SELECT count(*) FROM outbox_event WHERE event_type = 'ai.summary_failed'"
        )
    assert events == 1


@pytest.mark.parametrize(
    ("fields", "detail"),
    [
        ({**DEFAULT_SUMMARY, "summary": "door\u0000open"}, "summary holds U+0000"),
        ({**DEFAULT_SUMMARY, "inspection_suggestion": "\u0000"}, "suggestion holds U+0000"),
        ({**DEFAULT_SUMMARY, "note\u0000": "x"}, "unknown field `note\\u0000`"),
    ],
    ids=["nul-in-the-summary", "nul-alone", "nul-in-an-unknown-field-name"],
)
async def test_an_answer_holding_a_nul_fails_as_invalid_output_with_the_raw_response_kept(
    pool: asyncpg.Pool, llm_server: FakeLlm, fields: dict[str, object], detail: str
) -> None:
    """PostgreSQL text cannot hold a NUL: the summary is refused as invalid output, not left
    PROCESSING by a refused write (then failed as WORKER_LOST with the answer lost)."""
    alarm_id = await _alarm(pool)
    content = json.dumps(fields)
    body = json.dumps(llm_server.completion(content))
    llm_server.reply_raw(body)
    await _worker(pool, llm_server).run_once()
    first, retry = await ai_repo_for(pool, alarm_id)
    assert (first["status"], first["error_code"]) == ("FAILED", "LLM_OUTPUT_INVALID")
    assert first["raw_response"] == body  # JSON escapes its NUL: the body is kept as received
    assert detail in first["error_message"]
    assert (retry["attempt"], retry["status"]) == (2, "PENDING")
    [event] = await _events(pool, "ai.summary_failed")
    assert event["task"]["error_message"] == first["error_message"]


# The server's status and body; the raw response, error code and error message stored.
NUL_FAILURES: dict[str, tuple[int, str, str, str, str]] = {
    "nul-byte-in-an-error-body": (
        502, '{"error": "bad\x00gateway"}',
        '{"error": "bad\\u0000gateway"}', "LLM_HTTP_502", "bad\\u0000gateway",
    ),
    "escaped-nul-in-its-message": (
        502, '{"error": "bad\\u0000gateway"}',
        '{"error": "bad\\u0000gateway"}', "LLM_HTTP_502", "bad\\u0000gateway",
    ),
    "nul-byte-after-a-200": (
        200, '{"choices": []}\x00', '{"choices": []}\\u0000', "LLM_PROTOCOL", "not JSON",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", NUL_FAILURES.values(), ids=NUL_FAILURES.keys())
async def test_a_nul_in_a_failed_answer_is_stored_escaped_and_the_failure_recorded(
    pool: asyncpg.Pool, llm_server: FakeLlm, case: tuple[int, str, str, str, str]
) -> None:
    """The raw response and the error message are kept whatever the server sent: a NUL is
    written as its JSON escape, \\u0000, in the row and in the event."""
    status, body, kept, code, message = case
    alarm_id = await _alarm(pool)
    llm_server.reply_raw(body, status=status)
    await _worker(pool, llm_server).run_once()
    first, retry = await ai_repo_for(pool, alarm_id)
    assert (first["status"], first["error_code"]) == ("FAILED", code)
    assert first["raw_response"] == kept
    assert message in first["error_message"]
    assert "\x00" not in first["error_message"]
    assert retry["status"] == "PENDING"
    [event] = await _events(pool, "ai.summary_failed")
    assert event["task"]["error_message"] == first["error_message"]


@pytest.mark.parametrize(
    ("reported", "stored"),
    [("fake\x00model", "fake\\u0000model"), ("  ", "fake-model")],
    ids=["nul-escaped", "blank-is-the-requested-one"],
)
async def test_the_model_name_the_server_reports_is_stored_as_the_table_can_hold_it(
    pool: asyncpg.Pool, llm_server: FakeLlm, reported: str, stored: str
) -> None:
    alarm_id = await _alarm(pool)
    llm_server.reply(json.dumps(DEFAULT_SUMMARY), model=reported)
    await _worker(pool, llm_server).run_once()
    [task] = await ai_repo_for(pool, alarm_id)
    assert (task["status"], task["model_name"]) == ("SUCCEEDED", stored)
    [event] = await _events(pool, "ai.summary_succeeded")
    assert event["task"]["model_name"] == stored


async def _events(pool: asyncpg.Pool, event_type: str) -> list[dict[str, Any]]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT payload::text FROM outbox_event WHERE event_type = $1 ORDER BY id", event_type
        )
    return [json.loads(row["payload"]) for row in rows]


async def ai_repo_for(pool: asyncpg.Pool, alarm_id: int) -> list[asyncpg.Record]:
    async with pool.acquire() as conn:
        return await ai_repo.for_alarm(conn, alarm_id)


async def test_timeouts_and_http_errors_are_coded(pool: asyncpg.Pool, llm_server: FakeLlm) -> None:
    silent = await _alarm(pool, 1)
    llm_server.hang()
    await _worker(pool, llm_server, timeout_s=0.3).run_once()
    assert (await ai_repo_for(pool, silent))[0]["error_code"] == "LLM_TIMEOUT"

    broken = await _alarm(pool, 2, device="door-2")
    llm_server.reply('{"error": "boom"}', status=500)
    await _worker(pool, llm_server).run_once()
    failed = (await ai_repo_for(pool, broken))[0]
    assert failed["error_code"] == "LLM_HTTP_500"
    assert "boom" in failed["raw_response"]


async def test_two_workers_racing_for_one_task_claim_it_once(
    pool: asyncpg.Pool, llm_server: FakeLlm
) -> None:
    await _alarm(pool)
    workers = [_worker(pool, llm_server) for _ in range(2)]
    gate = asyncio.Event()

    async def claim(worker: SummaryWorker) -> object:
        await gate.wait()
        return await worker.claim()

    tasks = [asyncio.create_task(claim(w)) for w in workers]
    gate.set()
    claims = await asyncio.gather(*tasks)
    assert sum(c is not None for c in claims) == 1


async def test_a_task_reset_during_the_call_keeps_its_reset(
    pool: asyncpg.Pool, llm_server: FakeLlm
) -> None:
    alarm_id = await _alarm(pool)
    llm_server.delay(1.0)
    worker = _worker(pool, llm_server)
    claimed = await worker.claim()
    assert claimed is not None
    call = asyncio.create_task(worker.process(claimed))
    await llm_server.wait_for_requests(1)
    async with pool.acquire() as conn:
        assert await ai_repo.reset(conn, claimed.task_id)
    await call
    task = await _task(pool, alarm_id)
    assert task["status"] == "PENDING"  # the late result was not written
    assert task["summary"] is None


async def test_a_killed_worker_is_swept_as_worker_lost_then_retried(
    pool: asyncpg.Pool, llm_server: FakeLlm
) -> None:
    alarm_id = await _alarm(pool)
    dead = _worker(pool, llm_server)
    assert await dead.claim() is not None  # ... and the worker dies here, mid-call
    async with pool.acquire() as conn:
        await conn.execute("UPDATE ai_task SET started_at = now() - interval '1 hour'")
    survivor = _worker(pool, llm_server, processing_timeout_s=60)
    assert len(await survivor.sweep()) == 1
    lost, retry = await ai_repo_for(pool, alarm_id)
    assert (lost["status"], lost["error_code"]) == ("FAILED", "WORKER_LOST")
    assert lost["request_payload"] is not None  # built at claim time: the audit is complete
    async with pool.acquire() as conn:
        await conn.execute("UPDATE ai_task SET next_attempt_at = now() WHERE id = $1", retry["id"])
    assert await survivor.run_once()
    assert (await _task(pool, alarm_id))["status"] == "SUCCEEDED"


async def test_credentials_in_the_base_url_reach_no_log_line_no_task_and_no_event(
    db_dsn: str, mosquitto: Mosquitto, llm_server: FakeLlm
) -> None:
    """The URL's userinfo authenticates (Basic); the start's log line, the failed task's
    error message and its event name the server without it."""
    base_url = llm_server.base_url.replace("http://", "http://gw:url-pass-0123@")
    llm_server.reply('{"error": "boom"}', status=500)
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        extra=(
            '[[rules]]\nkey = "door-open"\nkind = "event"\nevent = "DOOR_OPEN"\n'
            'severity = "MAJOR"\n'
            f'[ai]\nenabled = true\nbase_url = "{base_url}"\nmodel = "fake-model"\n'
            "max_attempts = 1\n"
        ),
    )  # fmt: skip

    async def failed() -> bool:
        conn = await asyncpg.connect(db_dsn)
        try:
            return bool(await conn.fetchval("SELECT count(*) FROM ai_task WHERE status = 'FAILED'"))
        finally:
            await conn.close()

    with capture_logs() as logs:
        async with running_daemon(config):
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
                door = b'{"ts": 1, "events": [{"type": "DOOR_OPEN"}]}'
                await pub.publish(Topics("iot").telemetry("door-1"), door, qos=1)
            await wait_until(failed, timeout=30, message="the task FAILED")
    assert llm_server.headers[0]["Authorization"].startswith("Basic ")
    [started] = [line for line in logs if line["event"] == "ai_summaries_enabled"]
    assert started["base_url"] == llm_server.base_url
    assert "url-pass-0123" not in repr(logs)
    conn = await asyncpg.connect(db_dsn)
    try:
        [task] = await conn.fetch("SELECT error_code, error_message FROM ai_task")
        [event] = await conn.fetch(
            "SELECT payload::text FROM outbox_event WHERE event_type = 'ai.summary_failed'"
        )
    finally:
        await conn.close()
    assert task["error_code"] == "LLM_HTTP_500"
    assert f"from {llm_server.base_url}/chat/completions: boom" in task["error_message"]
    assert "url-pass-0123" not in event["payload"]
    assert "gw:" not in task["error_message"] + event["payload"]


async def test_a_slow_llm_holds_no_connection_and_ingest_keeps_going(
    db_dsn: str, mosquitto: Mosquitto, llm_server: FakeLlm
) -> None:
    llm_server.delay(2.0)
    token = "admin-token-0123456789"
    viewer = "viewer-token-0123456789"
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        extra=(
            '[[rules]]\nkey = "door-open"\nkind = "event"\nevent = "DOOR_OPEN"\n'
            'severity = "MAJOR"\n'
            f'[ai]\nenabled = true\nbase_url = "{llm_server.base_url}"\nmodel = "fake-model"\n'
            "workers = 20\ntimeout_s = 30\n"
            f'[[api.tokens]]\ntoken = "{token}"\nrole = "admin"\nname = "admin"\n'
            f'[[api.tokens]]\ntoken = "{viewer}"\nrole = "viewer"\nname = "viewer"\n'
        ),
    )  # fmt: skip
    topics = Topics("iot")
    doors = [(topics.telemetry(f"door-{n}"), b'{"ts": 1, "events": [{"type": "DOOR_OPEN"}]}')
             for n in range(100)]  # fmt: skip
    readings = [(topics.telemetry(f"meter-{n % 50}"), f'{{"ts": {n}, "metrics": {{"kwh": {n}}}}}'
                 .encode()) for n in range(2000)]  # fmt: skip
    async with running_daemon(config) as daemon:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=200) as pub:
            await publish_many(pub, doors, window=100)
            await wait_until(lambda: llm_server.in_flight >= 10, timeout=30,
                             message="many LLM calls in flight")  # fmt: skip
            # While 20 calls hang on the model, telemetry keeps flowing into the database ...
            await publish_many(pub, readings, window=200)
            await wait_until(
                lambda: metric(daemon, "gateway_telemetry_stored_total") >= 2100, timeout=60
            )
        assert llm_server.in_flight > 0, "the calls were still in flight while ingest went on"
        # ... because the calls hold no pooled connection.
        assert daemon.pool is not None
        assert daemon.pool.get_size() <= 10

        async def all_done() -> bool:
            conn = await asyncpg.connect(db_dsn)
            try:
                done = await conn.fetchval(
                    "SELECT count(*) FROM ai_task WHERE status = 'SUCCEEDED'"
                )
            finally:
                await conn.close()
            return bool(done == 100)

        await wait_until(all_done, timeout=120, message="100 summaries")
        async with aiohttp.ClientSession() as http:
            async with http.get(
                f"http://127.0.0.1:{daemon.http_port}/alarms?limit=1",
                headers={"Authorization": f"Bearer {token}"},
            ) as response:
                first = (await response.json())["items"][0]["id"]
            async with http.get(
                f"http://127.0.0.1:{daemon.http_port}/alarms/{first}",
                headers={"Authorization": f"Bearer {token}"},
            ) as response:
                body = await response.json()
            attempts = {}
            for who in (token, viewer):
                async with http.get(
                    f"http://127.0.0.1:{daemon.http_port}/alarms/{first}/summaries",
                    headers={"Authorization": f"Bearer {who}"},
                ) as response:
                    attempts[who] = (await response.json())["items"]
    assert "request_payload" in attempts[token][0]  # admins see what was sent and received
    assert "raw_response" in attempts[token][0]
    assert "request_payload" not in attempts[viewer][0]
    summary = body["ai_summary"]
    assert summary["status"] == "SUCCEEDED"
    assert summary["risk_level"] == DEFAULT_SUMMARY["risk_level"]
    assert summary["prompt_version"] == "v1"
