"""The AI task domain: the Summary the model must give, the outcomes' invariants, retries."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.domain.ai_task import (
    MAX_ATTEMPTS_DEFAULT,
    TEXT_MAX_CHARS,
    AiTaskError,
    ErrorCode,
    Failed,
    InvariantError,
    RiskLevel,
    Succeeded,
    Summary,
    TaskStatus,
    retry_delay_s,
    should_retry,
)
from gateway.domain.errors import GatewayError

T0 = datetime(2024, 5, 1, 8, 0, tzinfo=UTC)
FIELDS: dict[str, Any] = {
    "summary": "Temperature in cold room 2 rose to 9.5 °C.",
    "possible_cause": "The door was left open.",
    "inspection_suggestion": "Check the door contact and the compressor.",
    "risk_level": RiskLevel.HIGH,
    "confidence": 0.6,
}
PAYLOAD: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def summary(**changes: Any) -> Summary:
    return Summary(**{**FIELDS, **changes})


def test_enums_are_the_spec_values() -> None:
    assert list(TaskStatus) == ["PENDING", "PROCESSING", "SUCCEEDED", "FAILED"]
    assert list(RiskLevel) == ["LOW", "MEDIUM", "HIGH", "CRITICAL"]


def test_error_codes() -> None:
    assert ErrorCode.LLM_TIMEOUT == "LLM_TIMEOUT"
    assert ErrorCode.LLM_UNREACHABLE == "LLM_UNREACHABLE"
    assert ErrorCode.LLM_OUTPUT_INVALID == "LLM_OUTPUT_INVALID"
    assert ErrorCode.WORKER_LOST == "WORKER_LOST"
    assert ErrorCode.http(503) == "LLM_HTTP_503"
    assert ErrorCode.http(429) == "LLM_HTTP_429"
    for status in (0, 99, 600, -1):
        with pytest.raises(ValueError, match="HTTP status"):
            ErrorCode.http(status)


def test_errors_sit_under_the_gateway_root() -> None:
    assert issubclass(InvariantError, AiTaskError)
    assert issubclass(AiTaskError, GatewayError)


# --- Summary ----------------------------------------------------------------------------------

VALID_SUMMARIES: list[dict[str, Any]] = [
    {},
    {"confidence": 0.0},
    {"confidence": 1.0},
    {"confidence": 1},
    {"risk_level": RiskLevel.CRITICAL},
    {"summary": "s" * TEXT_MAX_CHARS},
    {"possible_cause": " x "},
    {"inspection_suggestion": "i" * TEXT_MAX_CHARS},
]


@pytest.mark.parametrize("changes", VALID_SUMMARIES)
def test_valid_summaries_are_built_and_decoded(changes: dict[str, Any]) -> None:
    built = summary(**changes)
    assert msgspec.convert({**FIELDS, **changes}, Summary) == built


# (the invariant, the change): refused when built in Python and when decoded.
INVALID_SUMMARIES: list[tuple[str, dict[str, Any]]] = [
    ("ai_task_result_text_valid", {"summary": ""}),
    ("ai_task_result_text_valid", {"summary": "  \n\t "}),
    ("ai_task_result_text_valid", {"summary": "s" * (TEXT_MAX_CHARS + 1)}),
    ("ai_task_result_text_valid", {"possible_cause": ""}),
    ("ai_task_result_text_valid", {"possible_cause": "c" * (TEXT_MAX_CHARS + 1)}),
    ("ai_task_result_text_valid", {"inspection_suggestion": " "}),
    ("ai_task_result_text_valid", {"inspection_suggestion": "i" * (TEXT_MAX_CHARS + 1)}),
    ("ai_task_result_text_valid", {"summary": 42}),
    # What PostgreSQL text cannot hold: the write would be refused, the answer lost.
    ("ai_task_result_text_valid", {"summary": "door\x00open"}),
    ("ai_task_result_text_valid", {"possible_cause": "\x00"}),
    ("ai_task_result_text_valid", {"inspection_suggestion": "check \ud800"}),
    ("ai_task_risk_level_valid", {"risk_level": "SEVERE"}),
    ("ai_task_risk_level_valid", {"risk_level": "high"}),
    ("ai_task_confidence_in_range", {"confidence": 1.7}),
    ("ai_task_confidence_in_range", {"confidence": -0.01}),
    ("ai_task_confidence_in_range", {"confidence": math.nan}),
    ("ai_task_confidence_in_range", {"confidence": math.inf}),
    ("ai_task_confidence_in_range", {"confidence": True}),
    ("ai_task_confidence_in_range", {"confidence": "0.5"}),
]


@pytest.mark.parametrize(("invariant", "changes"), INVALID_SUMMARIES)
def test_invalid_summaries_are_refused(invariant: str, changes: dict[str, Any]) -> None:
    with pytest.raises(InvariantError) as raised:
        summary(**changes)
    assert raised.value.invariant == invariant
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**FIELDS, **changes}, Summary)


def test_summary_refuses_unknown_and_missing_fields() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field `extra`"):
        msgspec.convert({**FIELDS, "extra": 1}, Summary)
    without = {k: v for k, v in FIELDS.items() if k != "confidence"}
    with pytest.raises(msgspec.ValidationError, match="missing required field `confidence`"):
        msgspec.convert(without, Summary)


def test_summary_is_frozen() -> None:
    with pytest.raises(AttributeError):
        summary().confidence = 0.1  # type: ignore[misc]  # frozen: the point of the test


# --- Succeeded / Failed -----------------------------------------------------------------------

SUCCEEDED: dict[str, Any] = {
    "summary": summary(),
    "model_name": "qwen2.5:7b",
    "prompt_version": "v1",
    "request_payload": PAYLOAD,
    "raw_response": msgspec.json.encode(FIELDS).decode(),
    "finished_at": T0,
}
FAILED: dict[str, Any] = {
    "model_name": "qwen2.5:7b",
    "prompt_version": "v1",
    "request_payload": PAYLOAD,
    "error_code": ErrorCode.LLM_TIMEOUT,
    "error_message": "no answer within 30 s",
    "finished_at": T0,
}


def test_valid_outcomes() -> None:
    done = Succeeded(**SUCCEEDED)
    assert done.summary.risk_level is RiskLevel.HIGH
    assert Failed(**FAILED).raw_response is None
    invalid = Failed(
        **{**FAILED, "error_code": ErrorCode.LLM_OUTPUT_INVALID, "raw_response": "Sorry!"}
    )
    assert invalid.raw_response == "Sorry!"
    # An empty answer is still the answer that was refused.
    assert Failed(**{**FAILED, "error_code": ErrorCode.LLM_OUTPUT_INVALID, "raw_response": ""})
    for code in (
        ErrorCode.LLM_TIMEOUT,
        ErrorCode.LLM_UNREACHABLE,
        ErrorCode.WORKER_LOST,
        ErrorCode.http(500),
    ):
        assert Failed(**{**FAILED, "error_code": code}).error_code == code


NAIVE = datetime(2024, 5, 1, 8, 0)

BROKEN_SUCCEEDED: list[tuple[str, dict[str, Any]]] = [
    ("ai_task_timestamps_timezone_aware", {"finished_at": NAIVE}),
    ("ai_task_model_name_not_blank", {"model_name": ""}),
    ("ai_task_model_name_not_blank", {"model_name": "  "}),
    ("ai_task_prompt_version_not_blank", {"prompt_version": ""}),
    ("ai_task_request_payload_valid", {"request_payload": {}}),
    ("ai_task_request_payload_valid", {"request_payload": [1]}),
    ("ai_task_request_payload_valid", {"request_payload": None}),
    ("ai_task_succeeded_has_result", {"raw_response": ""}),
    ("ai_task_succeeded_has_result", {"raw_response": " \n"}),
    ("ai_task_succeeded_has_result", {"summary": None}),
    ("ai_task_succeeded_has_result", {"summary": dict(FIELDS)}),
]


@pytest.mark.parametrize(("invariant", "changes"), BROKEN_SUCCEEDED)
def test_succeeded_checks_every_field(invariant: str, changes: dict[str, Any]) -> None:
    with pytest.raises(InvariantError) as raised:
        Succeeded(**{**SUCCEEDED, **changes})
    assert raised.value.invariant == invariant
    assert str(raised.value).startswith(f"{invariant}: ")


BROKEN_FAILED: list[tuple[str, dict[str, Any]]] = [
    ("ai_task_timestamps_timezone_aware", {"finished_at": NAIVE}),
    ("ai_task_model_name_not_blank", {"model_name": ""}),
    ("ai_task_prompt_version_not_blank", {"prompt_version": "\t"}),
    ("ai_task_request_payload_valid", {"request_payload": {}}),
    ("ai_task_error_code_valid", {"error_code": ""}),
    ("ai_task_error_code_valid", {"error_code": "llm_timeout"}),
    ("ai_task_error_code_valid", {"error_code": "LLM TIMEOUT"}),
    ("ai_task_error_code_valid", {"error_code": "LLM_TIMEOUT\n"}),
    ("ai_task_error_message_not_blank", {"error_message": ""}),
    ("ai_task_error_message_not_blank", {"error_message": "   "}),
    ("ai_task_output_invalid_keeps_raw", {"error_code": ErrorCode.LLM_OUTPUT_INVALID}),
]


@pytest.mark.parametrize(("invariant", "changes"), BROKEN_FAILED)
def test_failed_checks_every_field(invariant: str, changes: dict[str, Any]) -> None:
    with pytest.raises(InvariantError) as raised:
        Failed(**{**FAILED, **changes})
    assert raised.value.invariant == invariant


# --- retries ----------------------------------------------------------------------------------


def test_retry_delays_double_up_to_the_cap() -> None:
    rng = random.Random(7)
    for attempt, ceiling in [(1, 30.0), (2, 60.0), (3, 120.0), (8, 3600.0), (10_000, 3600.0)]:
        for _ in range(20):
            assert ceiling / 2 <= retry_delay_s(attempt, rng=rng) <= ceiling
    assert 5.0 <= retry_delay_s(3, base_s=2.5, cap_s=10.0, rng=rng) <= 10.0
    assert 15.0 <= retry_delay_s(1) <= 30.0  # the module's random by default


def test_retry_delays_are_jittered() -> None:
    assert len({retry_delay_s(3, rng=random.Random(seed)) for seed in range(20)}) == 20


@given(
    attempt=st.integers(min_value=1, max_value=10_000),
    base_s=st.floats(min_value=0.001, max_value=100.0),
    extra_s=st.floats(min_value=0.0, max_value=10_000.0),
    seed=st.integers(),
)
def test_retry_delay_stays_within_half_ceiling_and_cap(
    attempt: int, base_s: float, extra_s: float, seed: int
) -> None:
    cap_s = base_s + extra_s
    delay = retry_delay_s(attempt, base_s=base_s, cap_s=cap_s, rng=random.Random(seed))
    ceiling = min(cap_s, base_s * 2 ** min(attempt - 1, 64))
    assert ceiling / 2 <= delay <= ceiling <= cap_s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempt": 0}, "1-based"),
        ({"attempt": 1, "base_s": 0.0}, "base_s"),
        ({"attempt": 1, "base_s": 10.0, "cap_s": 5.0}, "base_s"),
    ],
)
def test_retry_delay_refuses_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        retry_delay_s(**kwargs)


def test_should_retry_while_attempts_remain() -> None:
    assert MAX_ATTEMPTS_DEFAULT == 3
    assert [should_retry(a, MAX_ATTEMPTS_DEFAULT) for a in (1, 2, 3, 4)] == [
        True,
        True,
        False,
        False,
    ]
    assert should_retry(1, 1) is False
    with pytest.raises(ValueError, match="1-based"):
        should_retry(0, 3)
    with pytest.raises(ValueError, match="max_attempts"):
        should_retry(1, 0)
