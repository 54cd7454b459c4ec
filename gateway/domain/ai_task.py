"""AI summary tasks: four states, the result the model must give, and the record's invariants.

Pure: no I/O and no clock reads. One row per attempt (``storage/migrations/0005_ai_tasks.sql``);
a retry is a new PENDING row with ``attempt + 1``, never a reset of the failed one. The table's
CHECK constraints carry the names used here, so the domain and the table report the same rule:

- ``ai_task_confidence_in_range``, ``ai_task_risk_level_valid``, ``ai_task_result_text_valid``:
  a :class:`Summary` (text fields not blank, at most :data:`TEXT_MAX_CHARS` characters, and
  without a character PostgreSQL text cannot hold: a NUL, a lone surrogate).
- ``ai_task_model_name_not_blank``, ``ai_task_prompt_version_not_blank``: every outcome says
  which model and which prompt produced it.
- ``ai_task_request_payload_valid``: the request payload is a non-empty JSON object.
- ``ai_task_succeeded_has_result``: SUCCEEDED has the summary and the raw response.
- ``ai_task_error_code_valid``, ``ai_task_error_message_not_blank``: FAILED says why.
- ``ai_task_output_invalid_keeps_raw``: ``LLM_OUTPUT_INVALID`` keeps the response it refused.
- ``ai_task_timestamps_timezone_aware``: domain only (a ``timestamptz`` is always aware).

The outcomes here are what a worker writes. Long after, retention may clear a finished task's
request payload and raw response (``payload_pruned_at``, ``ai_task_pruned_when_finished``);
the table's checks allow that state, which no outcome built here ever is.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Final

import msgspec

from gateway.domain.errors import GatewayError

MAX_ATTEMPTS_DEFAULT: Final = 3
TEXT_MAX_CHARS: Final = 2000
_ERROR_CODE: Final = re.compile(r"^[A-Z][A-Z0-9_]*$")
# What PostgreSQL text cannot hold: NUL, and a surrogate (no UTF-8 encodes one alone).
_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")


class TaskStatus(StrEnum):
    PENDING = "PENDING"
    PROCESSING = "PROCESSING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


class RiskLevel(StrEnum):
    LOW = "LOW"
    MEDIUM = "MEDIUM"
    HIGH = "HIGH"
    CRITICAL = "CRITICAL"


class ErrorCode:
    """The error codes of a FAILED task (``error_code`` column)."""

    LLM_TIMEOUT: Final = "LLM_TIMEOUT"
    LLM_UNREACHABLE: Final = "LLM_UNREACHABLE"
    LLM_OUTPUT_INVALID: Final = "LLM_OUTPUT_INVALID"
    WORKER_LOST: Final = "WORKER_LOST"
    # A fault of the gateway's own code met by the task (its prompt, the reading of its
    # answer): the task fails, the node goes on; the traceback is in the log.
    WORKER_FAILED: Final = "WORKER_FAILED"

    @staticmethod
    def http(status: int) -> str:
        """``LLM_HTTP_<status>``: the server answered with a non-success HTTP status."""
        if not 100 <= status <= 599:
            raise ValueError(f"not an HTTP status: {status}")
        return f"LLM_HTTP_{status}"


class AiTaskError(GatewayError):
    """Root of the AI task errors."""


class InvariantError(AiTaskError, ValueError):
    """A value breaks ``invariant`` (the name of the matching table constraint).

    A ``ValueError`` too, so that msgspec turns one raised while decoding a :class:`Summary`
    into a ``ValidationError``.
    """

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
        self.message = message


# Not blank: at least one non-whitespace character (the table says ``~ '\S'``).
_Text = Annotated[str, msgspec.Meta(max_length=TEXT_MAX_CHARS, pattern=r"\S")]
_Confidence = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class Summary(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the model must return. The ``Meta`` constraints give decoding precise messages
    (``Expected `float` <= 1.0 - at `$.confidence```); ``__post_init__`` holds the same rules
    for values built in Python, which msgspec does not validate."""

    summary: _Text
    possible_cause: _Text
    inspection_suggestion: _Text
    risk_level: RiskLevel
    confidence: _Confidence

    def __post_init__(self) -> None:
        for name in ("inspection_suggestion", "possible_cause", "summary"):
            problem = _text_problem(name, getattr(self, name))
            if problem is not None:
                raise InvariantError("ai_task_result_text_valid", problem)
        if not isinstance(self.risk_level, RiskLevel):
            raise InvariantError(
                "ai_task_risk_level_valid", f"risk_level {self.risk_level!r} is not a RiskLevel"
            )
        confidence: object = self.confidence
        if (
            isinstance(confidence, bool)
            or not isinstance(confidence, int | float)
            or not math.isfinite(confidence)
            or not 0.0 <= confidence <= 1.0
        ):
            raise InvariantError(
                "ai_task_confidence_in_range", f"confidence {confidence!r} is not in [0, 1]"
            )


def _blank(text: str) -> bool:
    return not text.strip()


def _text_problem(name: str, value: object) -> str | None:
    if not isinstance(value, str):
        return f"{name} is not a string: {value!r}"
    if _blank(value):
        return f"{name} is blank"
    if len(value) > TEXT_MAX_CHARS:
        return f"{name} has {len(value)} characters, more than {TEXT_MAX_CHARS}"
    unstorable = _UNSTORABLE.search(value)
    if unstorable is not None:
        code = f"U+{ord(unstorable.group()):04X}"
        return f"{name} holds {code}, which a database text cannot hold"
    return None


def _check_common(
    model_name: str, prompt_version: str, request_payload: object, finished_at: datetime
) -> None:
    if finished_at.utcoffset() is None:
        raise InvariantError(
            "ai_task_timestamps_timezone_aware", f"finished_at={finished_at} has no time zone"
        )
    if _blank(model_name):
        raise InvariantError("ai_task_model_name_not_blank", "model_name is blank")
    if _blank(prompt_version):
        raise InvariantError("ai_task_prompt_version_not_blank", "prompt_version is blank")
    if not isinstance(request_payload, dict) or not request_payload:
        raise InvariantError(
            "ai_task_request_payload_valid",
            f"request_payload must be a non-empty JSON object, got {request_payload!r}",
        )


@dataclass(frozen=True)
class Succeeded:
    """The outcome of a task whose response parsed into a :class:`Summary`."""

    summary: Summary
    model_name: str
    prompt_version: str
    request_payload: dict[str, object]
    raw_response: str
    finished_at: datetime

    def __post_init__(self) -> None:
        _check_common(self.model_name, self.prompt_version, self.request_payload, self.finished_at)
        if not isinstance(self.summary, Summary):
            raise InvariantError(
                "ai_task_succeeded_has_result", f"summary is not a Summary: {self.summary!r}"
            )
        if _blank(self.raw_response):
            raise InvariantError("ai_task_succeeded_has_result", "raw_response is blank")


@dataclass(frozen=True)
class Failed:
    """The outcome of a task that produced no summary; ``raw_response`` is whatever the model
    answered, if it answered (always kept for ``LLM_OUTPUT_INVALID``)."""

    model_name: str
    prompt_version: str
    request_payload: dict[str, object]
    error_code: str
    error_message: str
    finished_at: datetime
    raw_response: str | None = None

    def __post_init__(self) -> None:
        _check_common(self.model_name, self.prompt_version, self.request_payload, self.finished_at)
        if not _ERROR_CODE.fullmatch(self.error_code):
            raise InvariantError(
                "ai_task_error_code_valid",
                f"error_code {self.error_code!r} does not match {_ERROR_CODE.pattern}",
            )
        if _blank(self.error_message):
            raise InvariantError("ai_task_error_message_not_blank", "error_message is blank")
        if self.error_code == ErrorCode.LLM_OUTPUT_INVALID and self.raw_response is None:
            raise InvariantError(
                "ai_task_output_invalid_keeps_raw",
                "LLM_OUTPUT_INVALID keeps the raw response it refused",
            )


Outcome = Succeeded | Failed


def retry_delay_s(
    attempt: int,
    *,
    base_s: float = 30.0,
    cap_s: float = 3600.0,
    rng: random.Random | None = None,
) -> float:
    """Seconds before the attempt after ``attempt`` (1-based, the one that just failed).

    ``uniform(c / 2, c)`` with ``c = min(cap_s, base_s * 2**(attempt - 1))``: at least half the
    ceiling, so a retry never comes right back at an LLM that is struggling, and jittered, so
    the tasks of an alarm storm do not retry in lock step.
    """
    if attempt < 1:
        raise ValueError(f"attempt is 1-based, got {attempt}")
    if not 0 < base_s <= cap_s:
        raise ValueError("need 0 < base_s <= cap_s")
    # Bound the exponent: 2**1100 overflows a float long before anyone waits that long.
    ceiling = min(cap_s, base_s * 2.0 ** min(attempt - 1, 64))
    return (rng or random).uniform(ceiling / 2, ceiling)


def retry_delay_after_s(
    attempt: int,
    server_wait_s: float | None,
    *,
    cap_s: float = 3600.0,
    rng: random.Random | None = None,
) -> float:
    """:func:`retry_delay_s`, but never sooner than the wait the server asked for (its
    ``Retry-After``), that wait jittered up to a tenth more (the tasks of a storm that all
    met the same rate limit do not come back at the same instant), and at most ``cap_s``."""
    delay = retry_delay_s(attempt, rng=rng)
    if server_wait_s is None or not math.isfinite(server_wait_s) or server_wait_s <= 0:
        return delay
    asked = min(server_wait_s, cap_s)
    return max(delay, min(cap_s, asked * (rng or random).uniform(1.0, 1.1)))


def should_retry(attempt: int, max_attempts: int) -> bool:
    """Whether a failed ``attempt`` (1-based) gets another: while ``attempt < max_attempts``."""
    if attempt < 1:
        raise ValueError(f"attempt is 1-based, got {attempt}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
    return attempt < max_attempts
