"""The ai_task table enforces the AI task invariants: real PostgreSQL, constraint by name."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
import pytest

from gateway.domain.ai_task import (
    TEXT_MAX_CHARS,
    ErrorCode,
    Failed,
    InvariantError,
    RiskLevel,
    Succeeded,
    Summary,
    TaskStatus,
)

T0 = datetime(2024, 5, 1, 8, 0, tzinfo=UTC)
STARTED = T0 + timedelta(seconds=1)
FINISHED = T0 + timedelta(seconds=9)
ALARM_ID = 1
PAYLOAD: dict[str, object] = {"model": "qwen2.5:7b", "messages": [{"role": "user", "content": "x"}]}
RAW = (
    '{"summary": "s", "possible_cause": "c", "inspection_suggestion": "i", '
    '"risk_level": "HIGH", "confidence": 0.7}'
)

INSERT_ALARM = """
INSERT INTO alarm (id, device_id, rule_key, severity, status, telemetry_event_id, dedup_key,
                   active_key, triggered_at, node_id)
VALUES ($1, 'dev-1', 'temp_high', 'MAJOR', 'NEW', $2, 'temp_high:dev-1:' || $2,
        NULL, $3, 'node-a')
"""
COLUMNS = (
    "alarm_id",
    "attempt",
    "status",
    "model_name",
    "prompt_version",
    "request_payload",
    "raw_response",
    "summary",
    "possible_cause",
    "inspection_suggestion",
    "risk_level",
    "confidence",
    "error_code",
    "error_message",
    "claim_token",
    "claimed_by",
    "started_at",
    "finished_at",
    "payload_pruned_at",
)
INSERT = f"""
INSERT INTO ai_task ({", ".join(COLUMNS)})
VALUES ({", ".join(f"${i}" for i in range(1, len(COLUMNS) + 1))})
RETURNING id
"""  # noqa: S608 - column names are the constants above

PENDING: dict[str, Any] = {
    "alarm_id": ALARM_ID,
    "attempt": 1,
    "status": "PENDING",
    "model_name": "qwen2.5:7b",
    "prompt_version": "v1",
    "request_payload": None,
    "raw_response": None,
    "summary": None,
    "possible_cause": None,
    "inspection_suggestion": None,
    "risk_level": None,
    "confidence": None,
    "error_code": None,
    "error_message": None,
    "claim_token": None,
    "claimed_by": None,
    "started_at": None,
    "finished_at": None,
    "payload_pruned_at": None,
}
CLAIM: dict[str, Any] = {
    "claim_token": uuid.UUID(int=7),
    "claimed_by": "node-a",
    "started_at": STARTED,
    "request_payload": PAYLOAD,
}
PROCESSING: dict[str, Any] = {**PENDING, **CLAIM, "status": "PROCESSING"}
SUCCEEDED: dict[str, Any] = {
    **PROCESSING,
    "status": "SUCCEEDED",
    "raw_response": RAW,
    "summary": "s",
    "possible_cause": "c",
    "inspection_suggestion": "i",
    "risk_level": "HIGH",
    "confidence": 0.7,
    "finished_at": FINISHED,
}
FAILED: dict[str, Any] = {
    **PROCESSING,
    "status": "FAILED",
    "error_code": ErrorCode.LLM_TIMEOUT,
    "error_message": "no answer within 30 s",
    "finished_at": FINISHED,
}

# One or more valid rows of every state.
VALID: dict[str, dict[str, Any]] = {
    "pending": PENDING,
    "pending_retry": {**PENDING, "attempt": 2},
    "processing": PROCESSING,
    "succeeded": SUCCEEDED,
    "succeeded_bounds": {
        **SUCCEEDED,
        "summary": "s" * TEXT_MAX_CHARS,
        "risk_level": "LOW",
        "confidence": 0.0,
    },
    "succeeded_sure": {**SUCCEEDED, "risk_level": "CRITICAL", "confidence": 1.0},
    "failed": FAILED,
    "failed_output_invalid": {
        **FAILED,
        "error_code": ErrorCode.LLM_OUTPUT_INVALID,
        "error_message": "invalid summary: Expected `float` <= 1.0 - at `$.confidence`",
        "raw_response": RAW.replace("0.7", "1.7"),
    },
    "failed_empty_answer": {
        **FAILED,
        "error_code": ErrorCode.LLM_OUTPUT_INVALID,
        "error_message": "response is empty",
        "raw_response": "",
    },
    "failed_http": {**FAILED, "error_code": ErrorCode.http(503), "raw_response": "busy"},
    "failed_worker_lost": {**FAILED, "error_code": ErrorCode.WORKER_LOST},
    "failed_unclaimed": {
        **FAILED,
        "claim_token": None,
        "claimed_by": None,
        "started_at": None,
    },
    # Past [retention] ai_payload_days: the payloads cleared, the rest kept.
    "succeeded_pruned": {
        **SUCCEEDED,
        "request_payload": None,
        "raw_response": None,
        "payload_pruned_at": FINISHED,
    },
    "failed_output_invalid_pruned": {
        **FAILED,
        "error_code": ErrorCode.LLM_OUTPUT_INVALID,
        "request_payload": None,
        "raw_response": None,
        "payload_pruned_at": FINISHED,
    },
}


async def insert(db: asyncpg.Connection, row: dict[str, Any], attempt: int | None = None) -> int:
    values = {**row}
    if values["request_payload"] is not None:
        values["request_payload"] = msgspec.json.encode(values["request_payload"]).decode()
    if attempt is not None:
        values["attempt"] = attempt
    task_id: int = await db.fetchval(INSERT, *(values[name] for name in COLUMNS))
    return task_id


@pytest.fixture
async def alarm(db: asyncpg.Connection) -> int:
    await db.execute(INSERT_ALARM, ALARM_ID, "e" * 64, T0)
    return ALARM_ID


async def test_valid_rows_of_every_state_are_accepted(db: asyncpg.Connection, alarm: int) -> None:
    assert {row["status"] for row in VALID.values()} == set(TaskStatus)
    for attempt, row in enumerate(VALID.values(), start=1):
        await insert(db, row, attempt=attempt)
    assert await db.fetchval("SELECT count(*) FROM ai_task") == len(VALID)


async def test_defaults(db: asyncpg.Connection, alarm: int) -> None:
    task_id = await db.fetchval(
        "INSERT INTO ai_task (alarm_id, attempt, model_name, prompt_version) "
        "VALUES ($1, 1, 'm', 'v1') RETURNING id",
        alarm,
    )
    row = await db.fetchrow("SELECT * FROM ai_task WHERE id = $1", task_id)
    assert row is not None
    assert row["status"] == "PENDING"
    assert row["next_attempt_at"] == row["created_at"]
    assert row["started_at"] is None
    assert row["finished_at"] is None


# (constraint, a valid row, the change that breaks only that constraint)
BROKEN: list[tuple[str, str, dict[str, Any]]] = [
    ("ai_task_attempt_positive", "pending", {"attempt": 0}),
    ("ai_task_attempt_positive", "pending", {"attempt": -1}),
    ("ai_task_status_valid", "pending", {"status": "pending"}),
    ("ai_task_status_valid", "processing", {"status": "RUNNING"}),
    ("ai_task_model_name_not_blank", "pending", {"model_name": ""}),
    ("ai_task_model_name_not_blank", "succeeded", {"model_name": " \t"}),
    ("ai_task_prompt_version_not_blank", "failed", {"prompt_version": ""}),
    ("ai_task_request_payload_valid", "processing", {"request_payload": {}}),
    ("ai_task_request_payload_valid", "succeeded", {"request_payload": [1, 2]}),
    ("ai_task_request_payload_valid", "failed", {"request_payload": "text"}),
    ("ai_task_risk_level_valid", "succeeded", {"risk_level": "SEVERE"}),
    ("ai_task_risk_level_valid", "succeeded", {"risk_level": "high"}),
    ("ai_task_confidence_in_range", "succeeded", {"confidence": 1.7}),
    ("ai_task_confidence_in_range", "succeeded", {"confidence": -0.1}),
    ("ai_task_confidence_in_range", "succeeded", {"confidence": float("nan")}),
    ("ai_task_confidence_in_range", "succeeded", {"confidence": float("inf")}),
    ("ai_task_error_code_valid", "failed", {"error_code": ""}),
    ("ai_task_error_code_valid", "failed", {"error_code": "llm_timeout"}),
    ("ai_task_error_message_not_blank", "failed", {"error_message": ""}),
    ("ai_task_error_message_not_blank", "failed", {"error_message": "  \n"}),
    ("ai_task_result_text_valid", "succeeded", {"summary": ""}),
    ("ai_task_result_text_valid", "succeeded", {"summary": "s" * (TEXT_MAX_CHARS + 1)}),
    ("ai_task_result_text_valid", "succeeded", {"possible_cause": " "}),
    ("ai_task_result_text_valid", "succeeded", {"possible_cause": "c" * (TEXT_MAX_CHARS + 1)}),
    ("ai_task_result_text_valid", "succeeded", {"inspection_suggestion": "\t"}),
    (
        "ai_task_result_text_valid",
        "succeeded",
        {"inspection_suggestion": "i" * (TEXT_MAX_CHARS + 1)},
    ),
    ("ai_task_output_invalid_keeps_raw", "failed_output_invalid", {"raw_response": None}),
    ("ai_task_claim_pair", "processing", {"claimed_by": None}),
    ("ai_task_claim_pair", "succeeded", {"claim_token": None}),
    ("ai_task_claim_pair", "failed", {"claimed_by": " "}),
    ("ai_task_finished_after_started", "succeeded", {"finished_at": STARTED - timedelta(1)}),
    ("ai_task_finished_after_started", "failed", {"started_at": FINISHED + timedelta(1)}),
    (
        "ai_task_pending_is_unclaimed",
        "pending",
        {"claim_token": uuid.UUID(int=1), "claimed_by": "n"},
    ),
    ("ai_task_pending_is_unclaimed", "pending", {"started_at": STARTED}),
    ("ai_task_pending_is_unclaimed", "pending", {"request_payload": PAYLOAD}),
    ("ai_task_open_has_no_outcome", "pending", {"finished_at": FINISHED}),
    ("ai_task_open_has_no_outcome", "pending", {"error_code": "LLM_TIMEOUT"}),
    ("ai_task_open_has_no_outcome", "processing", {"finished_at": FINISHED}),
    ("ai_task_open_has_no_outcome", "processing", {"raw_response": RAW}),
    ("ai_task_open_has_no_outcome", "processing", {"summary": "s"}),
    ("ai_task_open_has_no_outcome", "processing", {"risk_level": "LOW"}),
    ("ai_task_open_has_no_outcome", "processing", {"confidence": 0.5}),
    ("ai_task_open_has_no_outcome", "processing", {"error_message": "boom"}),
    ("ai_task_processing_has_claim", "processing", {"claim_token": None, "claimed_by": None}),
    ("ai_task_processing_has_claim", "processing", {"started_at": None}),
    ("ai_task_processing_has_claim", "processing", {"request_payload": None}),
    ("ai_task_succeeded_has_result", "succeeded", {"summary": None}),
    ("ai_task_succeeded_has_result", "succeeded", {"possible_cause": None}),
    ("ai_task_succeeded_has_result", "succeeded", {"inspection_suggestion": None}),
    ("ai_task_succeeded_has_result", "succeeded", {"risk_level": None}),
    ("ai_task_succeeded_has_result", "succeeded", {"confidence": None}),
    ("ai_task_succeeded_has_result", "succeeded", {"request_payload": None}),
    ("ai_task_succeeded_has_result", "succeeded", {"raw_response": None}),
    ("ai_task_succeeded_has_result", "succeeded", {"raw_response": " "}),
    ("ai_task_succeeded_has_result", "succeeded", {"started_at": None}),
    ("ai_task_succeeded_has_result", "succeeded", {"finished_at": None}),
    ("ai_task_succeeded_has_no_error", "succeeded", {"error_code": "LLM_TIMEOUT"}),
    ("ai_task_succeeded_has_no_error", "succeeded", {"error_message": "boom"}),
    ("ai_task_failed_has_error", "failed", {"error_code": None}),
    ("ai_task_failed_has_error", "failed", {"error_message": None}),
    ("ai_task_failed_has_error", "failed", {"request_payload": None}),
    ("ai_task_failed_has_error", "failed", {"finished_at": None}),
    ("ai_task_failed_has_no_result", "failed", {"summary": "s"}),
    ("ai_task_failed_has_no_result", "failed", {"risk_level": "LOW"}),
    ("ai_task_failed_has_no_result", "failed", {"confidence": 0.1}),
    ("ai_task_pruned_when_finished", "pending", {"payload_pruned_at": FINISHED}),
    ("ai_task_pruned_when_finished", "succeeded_pruned", {"request_payload": PAYLOAD}),
    ("ai_task_pruned_when_finished", "succeeded_pruned", {"raw_response": RAW}),
    ("ai_task_pruned_when_finished", "failed_output_invalid_pruned", {"raw_response": "x"}),
    ("ai_task_succeeded_has_result", "succeeded_pruned", {"summary": None}),
]


async def check_names(db: asyncpg.Connection) -> set[str]:
    return {
        r["conname"]
        for r in await db.fetch(
            "SELECT conname FROM pg_constraint "
            "WHERE conrelid = 'ai_task'::regclass AND contype = 'c'"
        )
    }


async def test_every_check_constraint_has_a_breaking_row(db: asyncpg.Connection) -> None:
    assert await check_names(db) == {name for name, _, _ in BROKEN}


@pytest.mark.parametrize(("constraint", "base", "changes"), BROKEN)
async def test_rows_breaking_an_invariant_are_rejected_by_its_check(
    db: asyncpg.Connection, alarm: int, constraint: str, base: str, changes: dict[str, Any]
) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as raised:
        await insert(db, {**VALID[base], **changes})
    assert raised.value.constraint_name == constraint
    await insert(db, VALID[base])


async def test_one_row_per_attempt(db: asyncpg.Connection, alarm: int) -> None:
    await insert(db, FAILED, attempt=1)
    with pytest.raises(asyncpg.UniqueViolationError) as raised:
        await insert(db, PENDING, attempt=1)
    assert raised.value.constraint_name == "ai_task_alarm_attempt_unique"
    await insert(db, PENDING, attempt=2)


async def test_a_task_belongs_to_an_alarm(db: asyncpg.Connection) -> None:
    with pytest.raises(asyncpg.ForeignKeyViolationError) as raised:
        await insert(db, PENDING)
    assert raised.value.constraint_name == "ai_task_alarm_id_fkey"


async def test_domain_outcomes_fit_the_table(db: asyncpg.Connection, alarm: int) -> None:
    """What the domain accepts, the table accepts: write a Succeeded and a Failed as rows."""
    summary = Summary(
        summary="s" * TEXT_MAX_CHARS,
        possible_cause=" c ",
        inspection_suggestion="i",
        risk_level=RiskLevel.CRITICAL,
        confidence=1.0,
    )
    done = Succeeded(summary, "m", "v1", PAYLOAD, RAW, FINISHED)
    failed = Failed("m", "v1", PAYLOAD, ErrorCode.LLM_OUTPUT_INVALID, "bad", FINISHED, "")
    await insert(
        db,
        {
            **SUCCEEDED,
            **msgspec.structs.asdict(done.summary),
            "risk_level": str(done.summary.risk_level),
            "model_name": done.model_name,
            "prompt_version": done.prompt_version,
            "request_payload": done.request_payload,
            "raw_response": done.raw_response,
            "finished_at": done.finished_at,
        },
        attempt=1,
    )
    await insert(
        db,
        {
            **FAILED,
            "model_name": failed.model_name,
            "prompt_version": failed.prompt_version,
            "request_payload": failed.request_payload,
            "error_code": failed.error_code,
            "error_message": failed.error_message,
            "raw_response": failed.raw_response,
            "finished_at": failed.finished_at,
        },
        attempt=2,
    )
    # And what the table refuses, the domain refuses under the same name.
    with pytest.raises(asyncpg.CheckViolationError) as table:
        await insert(db, {**FAILED, "error_code": ErrorCode.LLM_OUTPUT_INVALID}, attempt=3)
    with pytest.raises(InvariantError) as domain:
        Failed("m", "v1", PAYLOAD, ErrorCode.LLM_OUTPUT_INVALID, "bad", FINISHED)
    assert table.value.constraint_name == domain.value.invariant


async def test_indexes(db: asyncpg.Connection) -> None:
    indexes = {
        r["indexname"]: r["indexdef"].split(" USING btree ", 1)[1]
        for r in await db.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'ai_task'"
        )
    }
    assert indexes == {
        "ai_task_pkey": "(id)",
        "ai_task_alarm_attempt_unique": "(alarm_id, attempt)",
        "ai_task_due_idx": "(status, next_attempt_at, id)",
        "ai_task_started_idx": "(status, started_at)",
        "ai_task_payload_kept_idx": "(id) WHERE (payload_pruned_at IS NULL)",
    }


async def test_latest_attempt_reads_the_unique_index_backwards(
    db: asyncpg.Connection, alarm: int
) -> None:
    for attempt in range(1, 4):
        await insert(db, FAILED, attempt=attempt)
    await db.execute("SET enable_seqscan = off")
    rows = await db.fetch(
        "EXPLAIN (FORMAT TEXT) SELECT * FROM ai_task WHERE alarm_id = $1 "
        "ORDER BY attempt DESC LIMIT 1",
        alarm,
    )
    plan = "\n".join(row[0] for row in rows)
    assert "Index Scan Backward using ai_task_alarm_attempt_unique" in plan
